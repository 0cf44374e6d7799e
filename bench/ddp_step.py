"""Median DDP training-step time under each communication hook, and where the host time of a step goes.

    python -m bench.ddp_step                               # world size 1 on one GPU (NCCL), or gloo on CPU
    torchrun --nproc_per_node=8 -m bench.ddp_step          # any world size
    python -m bench.ddp_step --model gpt2                  # a GPT-2-small-shaped transformer instead of the MLP
    python -m bench.ddp_step --profile --variants no_hook,triton_hook_bf16 --steps 10   # per-bucket host times
    python -m bench.ddp_step --small --steps 5             # a quick CPU smoke run (also with --model/--profile)

Models (``--model``, built in bench/ddp_models.py, which gives their shapes): ``mlp`` (default), a 100.7M-parameter
MLP at batch 64, or ``gpt2``, GPT-2 small's shape (124.4M parameters, batch 8 x 1024 tokens, bf16 autocast on
CUDA). ``--small`` shrinks either to seconds on a CPU; ``--batch`` and ``--seq`` set other sizes.

Each variant (no hook, torch's allreduce_hook and bf16_compress_hook, triton_hook in bfloat16 and float32, and
triton_hook in bfloat16 followed by gradient clipping, "hook + clip via state" (``ddp_triton.clip_grad_norm_``
with the norm the unpack computed, ``grad_stats=True``) against "hook + torch clip"
(``torch.nn.utils.clip_grad_norm_``, which reads every gradient again)) runs with
``gradient_as_bucket_view`` off and on, on its own copy of the model, and is timed per step after warm-up (the
step is synchronised, so the time includes the all-reduces); the variants take turns in rounds, so that a slow
patch of the machine does not land on one of them. At world size 1 the all-reduce is nearly free and the
differences are the hooks' own cost. torch refuses bf16_compress_hook outside NCCL, so on gloo it is skipped.
``triton_hook_bf16_graph`` ("graph") is the whole step (zero_grad, forward, backward with triton_hook in bfloat16,
SGD) captured in one CUDA graph by torch's recipe for DDP and timed per replay, against the eager step without a
hook ("x no hook"): the host's share of a step, gone (CUDA and the MLP only).

``--timeline`` records one more step of each triton variant after the timed ones: when each bucket's stages and
chunks were issued and completed on rank 0, and the exchange exposed after the backward's last operation
(bench/timeline.py, a JSON and a PNG), with how much later than rank 0 the last of the ranks reached its last bucket
(the wall clock, shared by the emulated cluster's ranks): what rank 0 then waited for is a peer, not the exchange.
``triton_hook_fp8_2level_whole`` and ``triton_hook_fp8_whole`` are FP8 + error feedback, two-level and flat, with
every bucket in one piece (``DDP_TRITON_CHUNK_BYTES=0``), beside the variants whose large buckets go in chunks.

``--profile`` times nothing: for one variant at a time (each bucket view), after ``--warmup`` steps and one step of
the profiler's own warm-up it records ``--steps`` steps (5 unless given; ``--rounds`` does not apply) under
``torch.profiler`` (CPU, and CUDA on a GPU; every thread where torch can, so that gloo's thread, which runs late
unpacks, is in it), writes the chrome trace
(``ddp_trace-<model>-<variant>-view_<on|off>-rank<r>-<time>.json`` in ``--out-dir``), and reads it back into a
table per bucket (host time in the hook's call, a range this script puts around every hook, torch's too; in its
pack, collective and unpack; the GPU's idle time meanwhile) and one per step (the compute stream's idle gaps during
the backward, DDP's own ranges): bench/ddp_profile.py reads the trace and says what each column is. Profiled
steps carry the profiler's own cost, so their times are no benchmark result; ``--profile`` never appends to
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import functools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import ddp_triton  # noqa: E402
from bench.common import (OUT_DIR, append_results, environment, format_table, progress, save_json,  # noqa: E402
                          time_calls)
from bench.ddp_models import Workload, make_workload  # noqa: E402
from bench.ddp_profile import BACKWARD_RANGE, FORWARD_RANGE, analyse_trace, bucket_table, step_table  # noqa: E402
from bench.ddp_trace import range_hooks, record_trace, safe_name  # noqa: E402
from bench import timeline  # noqa: E402
from ddp_triton.machine import cost_model as cm  # noqa: E402
from ddp_triton.runtime.algo_groups import scoped_env  # noqa: E402
from ddp_triton.runtime.chunks import CHUNK_BYTES_ENV  # noqa: E402
from ddp_triton.tune.processes import leave_process_group  # noqa: E402

#: max_norm of the clipping variants: a value the model's gradients exceed, so that every step scales them.
CLIP_MAX_NORM = 1e-3

DEFAULT_VARIANTS = ("no_hook,allreduce_hook,bf16_compress_hook,triton_hook_bf16,triton_hook_fp32,"
                    "triton_hook_bf16_clip_state,triton_hook_bf16_clip_torch,triton_hook_bf16_graph")


# ---- the job, the variants, the step ---------------------------------------------------------------------------------


def init() -> torch.device:
    """Join torchrun's job, or make a job of one (a FileStore, so no port is needed)."""
    if "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_method, store = "env://", None
    else:
        rank, world = 0, 1
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, init_method=init_method)
    return device


#: Each timed step ends at a barrier of every rank (``--barrier``).
STEP_BARRIER = False

#: The profile ``triton_hook_auto`` follows (``--format-profile``).
FORMAT_PROFILE: Optional[str] = None


def register(ddp: DDP, variant: str, notes: List[str]) -> Optional[Callable[[], None]]:
    """Attach the variant's hook; each triton variant gets its own state (one per model). Returns the clip the
    variant runs after each backward, if it clips."""
    if variant == "triton_hook_bf16_clip_state":  # "hook + clip via state"
        state = ddp_triton.register(ddp, comm_dtype=torch.bfloat16, grad_stats=True)
        checked: List[bool] = []

        def clip_via_state() -> None:
            if not checked:  # once: a fallback to torch's clip would time the wrong thing
                checked.append(True)
                reason = state.cannot_vouch(ddp)
                if reason is not None:
                    notes.append(f"triton_hook_bf16_clip_state fell back to torch's clip: {reason}")
            ddp_triton.clip_grad_norm_(ddp, CLIP_MAX_NORM, state=state)

        return clip_via_state
    if variant == "triton_hook_bf16_clip_torch":  # "hook + torch clip"
        ddp_triton.register(ddp, comm_dtype=torch.bfloat16)
        return lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP_MAX_NORM)
    if variant == "allreduce_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif variant == "bf16_compress_hook":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif variant == "triton_hook_bf16":
        ddp_triton.register(ddp, comm_dtype=torch.bfloat16)
    elif variant == "triton_hook_fp32":
        ddp_triton.register(ddp, comm_dtype=torch.float32)
    elif variant == "triton_hook_bf16_fp32sum":  # bf16 on the wire, float32 sums (at two ranks one all-reduce)
        ddp_triton.register(ddp, comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)
    elif variant == "triton_hook_fp8":  # block-scaled E4M3 with error feedback
        ddp_triton.register(ddp, comm_dtype=torch.float8_e4m3fn)
    elif variant == "triton_hook_fp8_no_ef":
        ddp_triton.register(ddp, comm_dtype=torch.float8_e4m3fn, error_feedback=False)
    elif variant == "triton_hook_bf16_2level":  # reduced in the node in float32, bf16 between nodes
        ddp_triton.register(ddp, comm_dtype=torch.bfloat16, hierarchical=True)
    elif variant == "triton_hook_bf16_fp32sum_2level":
        ddp_triton.register(ddp, comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32, hierarchical=True)
    elif variant == "triton_hook_fp8_2level":  # reduced in the node in float32, FP8 + error feedback between nodes
        ddp_triton.register(ddp, comm_dtype=torch.float8_e4m3fn, hierarchical=True)
    elif variant == "triton_hook_fp8_2level_whole":  # the same, each bucket in one piece (no chunks)
        with scoped_env({CHUNK_BYTES_ENV: "0"}):
            ddp_triton.register(ddp, comm_dtype=torch.float8_e4m3fn, hierarchical=True)
    elif variant == "triton_hook_fp4":  # block-scaled 4-bit E2M1 with error feedback
        ddp_triton.register(ddp, comm_dtype="fp4e2m1+ef")
    elif variant == "triton_hook_fp4_2level":  # reduced in the node in float32, E2M1 + error feedback between nodes
        ddp_triton.register(ddp, comm_dtype="fp4e2m1+ef", hierarchical=True)
    elif variant == "triton_hook_fp4_2level_whole":
        with scoped_env({CHUNK_BYTES_ENV: "0"}):
            ddp_triton.register(ddp, comm_dtype="fp4e2m1+ef", hierarchical=True)
    elif variant == "triton_hook_fp8_whole":  # flat FP8 + error feedback, each bucket in one piece
        with scoped_env({CHUNK_BYTES_ENV: "0"}):
            ddp_triton.register(ddp, comm_dtype=torch.float8_e4m3fn)
    elif variant == "triton_hook_auto":  # each bucket in the format a profile chose for its size
        if FORMAT_PROFILE is None:
            raise ValueError("triton_hook_auto needs --format-profile FILE (a profile that chooses wire formats)")
        ddp_triton.register(ddp, comm_dtype="auto", profile=FORMAT_PROFILE)
    elif variant != "no_hook":
        raise ValueError(f"unknown variant {variant}")
    return None


def make_ddp(base: nn.Module, device: torch.device, gabv: bool = False) -> DDP:
    """A DDP model around a copy of ``base`` (the variants never share parameters or buckets)."""
    return DDP(copy.deepcopy(base), device_ids=[device.index] if device.type == "cuda" else None,
               gradient_as_bucket_view=gabv)


def make_step(ddp: nn.Module, loss: Callable[[nn.Module], torch.Tensor], opt: torch.optim.Optimizer,
              clip: Optional[Callable[[], None]] = None, ranges: bool = False) -> Callable[[], None]:
    """One training step: zero_grad, forward and loss, backward, the variant's clip, SGD. ``ranges``: inside
    profiler ranges ``ddp_step.forward`` / ``.backward`` / ``.clip`` / ``.optimizer`` (profiling only: the timed
    step stays as it was)."""
    if not ranges:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss(ddp).backward()
            if clip is not None:
                clip()
            opt.step()

        return step

    record = torch.profiler.record_function

    def step_in_ranges() -> None:
        opt.zero_grad(set_to_none=True)
        with record(FORWARD_RANGE):
            value = loss(ddp)
        with record(BACKWARD_RANGE):
            value.backward()
        if clip is not None:
            with record("ddp_step.clip"):
                clip()
        with record("ddp_step.optimizer"):
            opt.step()

    return step_in_ranges


def time_steps(ddp: nn.Module, loss: Callable[[nn.Module], torch.Tensor], steps: int, warmup: int,
               device: torch.device, clip: Optional[Callable[[], None]] = None) -> List[float]:
    """Milliseconds of each of ``steps`` synchronised steps (SGD, lr 1e-4), after ``warmup`` untimed ones; with
    ``--barrier`` each ends at a barrier of every rank, so that it is the slowest rank's step."""
    step = make_step(ddp, loss, torch.optim.SGD(ddp.parameters(), lr=1e-4), clip)
    if STEP_BARRIER:
        def step_then_barrier(step: Callable[[], None] = step) -> None:
            step()
            dist.barrier()

        step = step_then_barrier
    return time_calls(step, steps, warmup, device)


# ---- main ------------------------------------------------------------------------------------------------------------


#: Variants whose whole step (zero_grad, forward, backward with the hook, SGD) is one CUDA graph, and their options.
GRAPH_VARIANTS = {"triton_hook_bf16_graph": dict(comm_dtype=torch.bfloat16)}
#: torch's recipe for capturing DDP: at least this many eager steps first.
GRAPH_WARMUP = 11


def variants_to_run(variants: str, backend: str, notes: List[str], device: torch.device,
                    model: str) -> List[str]:
    """The requested variants this backend can run (bf16_compress_hook only on NCCL, as torch insists; graphs only
    on CUDA, and only for the MLP: GPT-2's autocast caches casts, which a graph cannot hold)."""
    out = []
    for variant in variants.split(","):
        if variant == "bf16_compress_hook" and backend != "nccl":
            notes.append(f"bf16_compress_hook skipped: torch allows it on NCCL only (backend {backend})")
            continue
        if variant in GRAPH_VARIANTS and (device.type != "cuda" or model != "mlp"):
            notes.append(f"{variant} skipped: a CUDA graph of the step needs a GPU and the MLP workload")
            continue
        out.append(variant)
    return out


def captured_step(base: nn.Module, loss: Callable[[nn.Module], torch.Tensor], device: torch.device, gabv: bool,
                  options: Dict[str, Any]) -> Callable[[], None]:
    """The whole step with triton_hook captured in one CUDA graph, by torch's recipe for DDP (docs/cuda-graphs.md):
    DDP built on the capture stream, eager warm-up, then capture; returns the replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        ddp = DDP(copy.deepcopy(base), device_ids=[device.index], gradient_as_bucket_view=gabv)
        ddp_triton.register(ddp, **options)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)

        def step() -> None:
            opt.zero_grad(set_to_none=False)  # the gradients stay where the graph writes them
            loss(ddp).backward()
            opt.step()

        for _ in range(GRAPH_WARMUP):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    return graph.replay


def link_bytes(iface: Optional[str]) -> Tuple[int, int]:
    """(tx, rx) bytes of this node's interface ``iface`` by the kernel's own counters, read by the node's local rank 0
    after every rank got here (0, 0 on the other ranks, or without ``iface``)."""
    if not iface:
        return 0, 0
    dist.barrier()
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return 0, 0
    stats = Path("/sys/class/net") / iface / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def node_link_per_step(tx: int, rx: int, steps: int) -> Dict[str, float]:
    """Bytes each node's link sent and received per step, the mean over the nodes (their local ranks 0 counted)."""
    counts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, (tx, rx, int(os.environ.get("LOCAL_RANK", "0")) == 0))
    leaders = [(t, r) for t, r, leader in counts if leader]
    return {"node_link_tx_bytes_per_step": sum(t for t, _ in leaders) / len(leaders) / steps,
            "node_link_rx_bytes_per_step": sum(r for _, r in leaders) / len(leaders) / steps}


def take_turns(timers: Sequence[Tuple[str, Callable[[int, int], List[float]]]], rounds: int, steps: int,
               warmup: int, later_warmup: int, link_iface: Optional[str], label: str = "") -> List[Dict[str, Any]]:
    """Time each variant (``timer(steps, warmup)``: milliseconds per step) in turn, ``rounds`` times: a slow patch of
    the machine (clocks, another tenant) hits them all alike. ``steps`` spread over the rounds, ``warmup`` untimed
    steps before a variant's first round and ``later_warmup`` before the others. A row per variant: the median and
    fastest step, the mean (a job's pace: its slow steps count as they cost it), and with ``link_iface`` the bytes each node's link moved per step (over the rounds after the
    first, when there are any: the first holds one-time traffic, DDP's rebuild after step 0, FP8's residual
    re-slice)."""
    times: List[List[float]] = [[] for _ in timers]
    link = [[0, 0, 0] for _ in timers]  # tx bytes, rx bytes, steps (warm-up included)
    per_round = max(1, steps // rounds)
    for round_ in range(rounds):
        for (variant, timer), ts, counts in zip(timers, times, link):
            warm = warmup if round_ == 0 else later_warmup
            counted = link_iface if round_ > 0 or rounds == 1 else None
            before = link_bytes(counted)
            ts += timer(per_round, warm)
            after = link_bytes(counted)
            if dist.get_rank() == 0:
                progress(f"{label}round {round_ + 1}/{rounds}: {variant} median {statistics.median(ts):.2f} ms over "
                         f"{len(ts)} steps")
            if counted:
                counts[:] = [counts[0] + after[0] - before[0], counts[1] + after[1] - before[1],
                             counts[2] + per_round + warm]
    rows = []
    for (variant, _), ts, counts in zip(timers, times, link):
        row = {"variant": variant, "median_ms": statistics.median(ts), "mean_ms": statistics.fmean(ts),
               "min_ms": min(ts), "steps": len(ts), "times_ms": ts}
        if link_iface:
            row.update(node_link_per_step(*counts))
        rows.append(row)
    return rows


def run_benchmark(args: argparse.Namespace, work: Workload, device: torch.device, views: Sequence[bool],
                  backend: str, notes: List[str]) -> List[Dict[str, Any]]:
    """Median step time per variant and bucket view, the variants taking turns in rounds; with ``--timeline``, then
    one recorded step of each triton variant (``bench/timeline.py``)."""
    rows: List[Dict[str, Any]] = []
    for gabv in views:
        timers, models = [], []
        for variant in variants_to_run(args.variants, backend, notes, device, work.env["model"]):
            if variant in GRAPH_VARIANTS:
                replay = captured_step(work.model, work.loss, device, gabv, GRAPH_VARIANTS[variant])
                timer = functools.partial(time_calls, replay, device=device)
            else:
                ddp = make_ddp(work.model, device, gabv)
                clip = register(ddp, variant, notes)
                timer = functools.partial(time_steps, ddp, work.loss, device=device, clip=clip)
                models.append((variant, ddp, clip))
            timers.append((variant, timer))
        view_rows = [{"variant": r["variant"], "gradient_as_bucket_view": gabv, **r}
                     for r in take_turns(timers, args.rounds, args.steps, args.warmup, 2, args.link_iface,
                                         f"bucket view {'on' if gabv else 'off'}, ")]
        if args.timeline:
            for variant, ddp, clip in models:
                summary = record_timeline(variant, ddp, clip, work, args)
                if summary is not None:
                    next(r for r in view_rows if r["variant"] == variant).update(summary)
        rows += view_rows
        del timers, models
        if device.type == "cuda":
            torch.cuda.empty_cache()

    baseline = {r["gradient_as_bucket_view"]: r["median_ms"] for r in rows if r["variant"] == "no_hook"}
    for r in rows:
        base_ms = baseline.get(r["gradient_as_bucket_view"])
        r["vs_no_hook"] = r["median_ms"] / base_ms if base_ms else None
    return rows


def record_timeline(variant: str, ddp: DDP, clip: Optional[Callable[[], None]], work: Workload,
                    args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """One step of ``variant`` with its exchange recorded (``bench/timeline.py``); rank 0 saves the JSON and plot.
    The exposed exchange and its ratio to the last bucket's link-byte time, or None for a variant without our
    state."""
    state = next((entry[1] for entry in getattr(ddp, "_comm_hooks", ()) if isinstance(entry[1], ddp_triton.CommState)),
                 None)
    if state is None:
        return None
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)

    def after() -> None:
        if clip is not None:
            clip()
        opt.step()

    dist.barrier()
    recorded = timeline.record_step(state, opt.zero_grad, lambda: work.loss(ddp), after)
    recorded["summary"] = timeline.summarize(recorded, functools.partial(node_link_bytes, state), args.link_mbit)
    every_rank: List[Optional[float]] = [None] * dist.get_world_size()
    own = timeline.last_hook_unix_s(recorded)
    dist.all_gather_object(every_rank, own)
    recorded["summary"]["peers_lag_ms"] = timeline.peers_lag_ms(own, every_rank)
    if dist.get_rank() == 0:
        timeline.save(variant, recorded, Path(args.out_dir) if args.out_dir is not None else None)
    return {f"timeline_{k}": v for k, v in recorded["summary"].items()}


def node_link_bytes(state: Any, elements: int) -> Optional[int]:
    """Bytes one node sends through its link for a two-level bucket of ``elements`` float32 gradients in
    ``state``'s format (its ranks' cross exchanges); None for a flat format."""
    ctx = state.context
    if ctx is None or ctx.nodes is None:
        return None
    return cm.two_level_node_bytes(elements, state.wire.flat().name, ctx.nodes.local_size, ctx.nodes.n_nodes)


def run_profiles(args: argparse.Namespace, work: Workload, device: torch.device, views: Sequence[bool],
                 backend: str, notes: List[str], out_dir: Path) -> List[Dict[str, Any]]:
    """Profile each variant and bucket view in turn (one model alive at a time); rank 0 reads its traces back."""
    rank = dist.get_rank()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    results: List[Dict[str, Any]] = []
    for gabv in views:
        for variant in variants_to_run(args.variants, backend, notes, device, work.env["model"]):
            if variant in GRAPH_VARIANTS:  # a replay runs no Python: nothing per bucket to attribute
                notes.append(f"{variant} not profiled: its step is one graph replay")
                continue
            ddp = make_ddp(work.model, device, gabv)
            range_hooks(ddp)
            clip = register(ddp, variant, notes)
            trace = out_dir / (safe_name("ddp_trace", work.env["model"], variant, f"view_{'on' if gabv else 'off'}",
                                         f"rank{rank}", stamp) + ".json")
            step = make_step(ddp, work.loss, torch.optim.SGD(ddp.parameters(), lr=1e-4), clip, ranges=True)
            all_threads, note = record_trace(step, args.steps, args.warmup, device, trace)
            if note:
                notes.append(note)
            del ddp, clip
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if rank != 0:
                continue
            result = analyse_trace(json.loads(trace.read_text()))
            result.update(variant=variant, gradient_as_bucket_view=gabv, trace=trace.name, all_threads=all_threads)
            results.append(result)
    return results


def report_profiles(env: Dict[str, Any], results: List[Dict[str, Any]], notes: List[str], out_dir: Path,
                    stem: str) -> Path:
    """Print the profiled variants' tables (per bucket, then per step) and save them, the rows behind them and each
    variant's whole analysis as ``<stem>-<time>.json`` in ``out_dir``; returns its path. Never touches RESULTS.md:
    profiled steps carry the profiler's cost."""
    tables = []
    for r in results:
        header = (f"{r['variant']}, gradient_as_bucket_view={r['gradient_as_bucket_view']}: {r['steps']} steps, "
                  f"trace {r['trace']}")
        tables.append({"variant": r["variant"], "gradient_as_bucket_view": r["gradient_as_bucket_view"],
                       "header": header, "table": bucket_table(r)})
    steps_table = step_table(results)
    rows = [{"variant": r["variant"], "gradient_as_bucket_view": r["gradient_as_bucket_view"], **b}
            for r in results for b in r["buckets"]]
    path = save_json(stem, {"env": env, "mode": "profile", "rows": rows, "profiles": results,
                            "tables": {"buckets": tables, "steps": steps_table}, "notes": sorted(set(notes))},
                     out_dir)
    text = "\n\n".join(f"{t['header']}\n\n{t['table']}" for t in tables)
    print(f"{env}\n\n{text}\n\nper step (means; GPU columns: the compute stream during the backward)\n\n"
          f"{steps_table}\n\nsaved {path} (traces beside it)")
    for n in sorted(set(notes)):
        print(n)
    return path


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="DDP step time under each communication hook")
    p.add_argument("--model", choices=("mlp", "gpt2"), default="mlp",
                   help="mlp: 100.7M-parameter MLP; gpt2: GPT-2 small's shape (bf16 autocast on CUDA)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per variant, over all rounds (default 100); with --profile, profiled steps "
                        "per variant (default 5)")
    p.add_argument("--rounds", type=int, default=5, help="the variants take turns this many times (not in --profile)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--barrier", action="store_true",
                   help="end each timed step at a barrier of every rank: the slowest rank's step, not rank 0's")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's intra-op threads per rank (torch.set_num_threads; default: torch's own, every core, "
                        "which ranks sharing a CPU oversubscribe)")
    p.add_argument("--batch", type=int, default=None, help="default: 64 (mlp), 8 (gpt2), 2 (gpt2 --small)")
    p.add_argument("--seq", type=int, default=None, help="gpt2: tokens per sequence (default: the context, 1024; "
                                                          "32 with --small)")
    p.add_argument("--blocks", type=int, default=None,
                   help="mlp: residual blocks of width 1024 (default 12: 100.7M parameters; 3: 25.2M)")
    p.add_argument("--backward-ms", type=float, default=0.0,
                   help="mlp: the backward sleeps this long in all, split between its layers (a GPU's backward, "
                        "which leaves the host's cores to the exchange; bench/ddp_models.py)")
    p.add_argument("--small", action="store_true",
                   help="a CPU smoke run: the MLP at width 128 and 2 blocks, GPT-2 at 2 layers and d_model 64")
    p.add_argument("--bucket-view", choices=("both", "off", "on"), default="both",
                   help="gradient_as_bucket_view settings to run")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--profile", action="store_true",
                   help="profile each variant instead of timing it: chrome traces and per-bucket host times; "
                        "e.g. --variants no_hook,triton_hook_bf16")
    p.add_argument("--link-iface", default=None,
                   help="also count the bytes this node's interface sends and receives per step (its kernel counters, "
                        "read by each node's local rank 0 around each variant's steps after the first round; eth0 "
                        "under bench.cluster)")
    p.add_argument("--timeline", action="store_true",
                   help="after the timed steps, record one step of each triton variant: when each bucket's stages "
                        "and chunks were issued and completed on rank 0, and the exchange exposed after the "
                        "backward's last operation (bench/timeline.py: JSON and PNG under --out-dir)")
    p.add_argument("--link-mbit", type=float, default=None,
                   help="the node link's rate in Mbit/s (the cluster's --link), to put the exposed exchange beside "
                        "the last bucket's link-byte time in --timeline's summary")
    p.add_argument("--format-profile", default=None, metavar="FILE",
                   help="the profile variant triton_hook_auto follows (one that chooses wire formats: ddp-triton "
                        "autotune --formats, or bench.format_timing --profile-out)")
    p.add_argument("--append-results", action="store_true",
                   help="also append the table to bench/RESULTS.md (a GPU run's; default: only the JSON under "
                        "--out-dir)")
    p.add_argument("--out-dir", default=None, help="where the JSON goes (default bench/out, which git ignores)")
    args = p.parse_args(argv)
    cpu_sized = not torch.cuda.is_available() and not (args.small or args.batch or args.seq or args.blocks)
    if cpu_sized:  # the full models take minutes a step on a CPU: the small ones, unless a size is given
        args.small = True
    if args.steps is None:
        args.steps = 5 if args.profile else (20 if cpu_sized else 100)
    if args.model == "mlp" and args.seq is not None:
        p.error("--seq applies to --model gpt2")
    if args.blocks is not None and (args.model != "mlp" or args.small or args.blocks < 1):
        p.error("--blocks takes a positive count, for --model mlp without --small")
    if args.backward_ms < 0 or (args.backward_ms and args.model != "mlp"):
        p.error("--backward-ms takes a non-negative time, for --model mlp")
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")

    global FORMAT_PROFILE, STEP_BARRIER
    FORMAT_PROFILE, STEP_BARRIER = args.format_profile, args.barrier
    if any(v in GRAPH_VARIANTS for v in args.variants.split(",")):
        # torch's recipe for capturing DDP in a CUDA graph: NCCL's async error handling off, before the group exists
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = init()
    rank, world = dist.get_rank(), dist.get_world_size()
    if cpu_sized and rank == 0:
        progress(f"no GPU: the small {args.model} and {args.steps} steps per variant (give --batch, --seq or "
                 "--blocks for another size)")
    work = make_workload(args.model, args.small, args.batch, args.seq, device, world, blocks=args.blocks,
                         backward_ms=args.backward_ms)
    backend = str(dist.get_backend()).lower()
    views = {"both": (False, True), "off": (False,), "on": (True,)}[args.bucket_view]

    # One untimed run first: the process's own first-use costs (allocator, kernels, threads) land here.
    warm = make_ddp(work.model, device)
    time_steps(warm, work.loss, 1, args.warmup, device)
    del warm

    notes: List[str] = []
    if args.profile:
        out_dir = Path(args.out_dir) if args.out_dir is not None else OUT_DIR
        results = run_profiles(args, work, device, views, backend, notes, out_dir)
    else:
        rows = run_benchmark(args, work, device, views, backend, notes)

    if rank == 0:
        env = environment(device)
        env.update(world_size=world, backend=backend, **work.env)
        if args.profile:
            env.update(profiled_steps=args.steps, warmup=args.warmup)
            report_profiles(env, results, notes, out_dir, work.stem.replace("ddp_step", "ddp_profile"))
        else:
            headers = ["variant", "bucket view", "median ms", "mean ms", "min ms", "x no hook (same view)"]
            if args.link_iface:
                headers += ["node link MB sent per step", "node link MB received per step"]
            if args.timeline:
                headers += ["exposed ms (timeline step)", "x last bucket's link-byte time",
                            "x link-byte time still to cross", "a peer's last hook, ms later"]
            table = format_table(headers, [[r["variant"], r["gradient_as_bucket_view"], r["median_ms"], r["mean_ms"],
                                            r["min_ms"], r["vs_no_hook"]]
                                           + ([r["node_link_tx_bytes_per_step"] / 1e6,
                                               r["node_link_rx_bytes_per_step"] / 1e6] if args.link_iface else [])
                                           + ([r.get("timeline_exposed_ms"), r.get("timeline_exposed_over_link"),
                                               r.get("timeline_exposed_over_pending_link"),
                                               r.get("timeline_peers_lag_ms")] if args.timeline else [])
                                           for r in rows])
            path = save_json(work.stem, {"env": env, "rows": rows, "notes": notes}, args.out_dir)
            print(f"{env}\n\n{table}\n\nsaved {path}")
            for n in sorted(set(notes)):
                print(n)
            if args.append_results:
                append_results(work.title, env, [table], sorted(set(notes)))
    leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
