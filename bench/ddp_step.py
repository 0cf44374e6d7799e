"""Median DDP training-step time under each communication hook, and where the host time of a step goes.

    python -m bench.ddp_step                               # world size 1 on one GPU (NCCL), or gloo on CPU
    torchrun --nproc_per_node=8 -m bench.ddp_step          # any world size
    python -m bench.ddp_step --model gpt2                  # a GPT-2-small-shaped transformer instead of the MLP
    python -m bench.ddp_step --profile --variants no_hook,triton_hook_bf16 --steps 10   # per-bucket host times
    python -m bench.ddp_step --small --steps 5             # a quick CPU smoke run (also with --model/--profile)

Models (``--model``):

- ``mlp`` (default): 12 blocks of Linear(1024, 4096) - GELU - Linear(4096, 1024), 100.7M parameters, batch 64,
  loss the mean square of the output. ``--small``: width 128, 2 blocks.
- ``gpt2``: a decoder-only transformer of GPT-2 small's shape (12 layers, d_model 768, 12 heads, MLP 3072, vocab
  50257, context 1024, pre-LayerNorm, tanh GELU, attention through ``scaled_dot_product_attention(is_causal=True)``,
  learned positions, input embedding and LM head tied as in GPT-2: 124.4M parameters), cross-entropy of the next
  token on random token ids, batch 8 x 1024 tokens. On CUDA the forward and the loss run under
  ``torch.autocast(dtype=torch.bfloat16)``, the usual mixed precision: parameters, gradients and so the DDP buckets
  stay float32. ``--small``: 2 layers, d_model 64, 4 heads, MLP 256, vocab 256, 32 tokens, batch 2 (seconds on CPU).
  ``--batch`` and ``--seq`` (at most the context) set other sizes.

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

``--profile`` times nothing: for one variant at a time (each bucket view), after ``--warmup`` steps and one step of
the profiler's own warm-up it records ``--steps`` steps (5 unless given; ``--rounds`` does not apply) under
``torch.profiler`` (CPU, and CUDA on a GPU; every thread where torch can, so that gloo's thread, which runs late
unpacks, is in it), writes the chrome trace
(``ddp_trace-<model>-<variant>-view_<on|off>-rank<r>-<time>.json`` in ``--out-dir``), and reads it back into a
table per bucket: host time in the hook's call (a range this script puts around every hook, torch's too), in the
hook's pack, in the collective's call (triton_hook's ``ddp_triton.all_reduce`` range, else torch's ``c10d::`` ops
inside the hook; without a hook the reducer's own ``c10d::`` calls, k-th call = bucket k), in the completion
(``ddp_triton.unpack``), and the compute stream's idle time on the GPU while the host was in that bucket's hook;
per step, the compute stream's idle gaps during the backward (the gaps between consecutive kernel, memcpy and
memset events on the stream that runs most of them, over the span of the backward's own GPU work) and DDP's own
ranges. Means over the profiled steps. On CPU there are no CUDA events: the GPU columns are None ("n/a"). Profiled
steps carry the profiler's own cost, so their times are no benchmark result; ``--profile`` never appends to
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import dataclasses
import datetime as _dt
import functools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import ddp_triton  # noqa: E402
from bench.common import OUT_DIR, append_results, environment, format_table, save_json  # noqa: E402
from ddp_triton.tune.processes import leave_process_group  # noqa: E402

#: max_norm of the clipping variants: a value the model's gradients exceed, so that every step scales them.
CLIP_MAX_NORM = 1e-3

DEFAULT_VARIANTS = ("no_hook,allreduce_hook,bf16_compress_hook,triton_hook_bf16,triton_hook_fp32,"
                    "triton_hook_bf16_clip_state,triton_hook_bf16_clip_torch,triton_hook_bf16_graph")


# ---- models ----------------------------------------------------------------------------------------------------------


def make_model(width: int, blocks: int) -> nn.Module:
    """The MLP: ``blocks`` times Linear(width, 4 width) - GELU - Linear(4 width, width)."""
    layers: List[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*layers)


@dataclasses.dataclass(frozen=True)
class Gpt2Config:
    """The shape of a GPT-2-style decoder; the defaults are GPT-2 small's."""

    layers: int = 12
    d_model: int = 768
    heads: int = 12
    mlp: int = 3072
    vocab: int = 50257
    context: int = 1024


GPT2_SMALL = Gpt2Config()
#: ``--small --model gpt2``: the same code at a size a CPU runs in seconds.
GPT2_SMOKE = Gpt2Config(layers=2, d_model=64, heads=4, mlp=256, vocab=256, context=32)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused QKV projection, SDPA with ``is_causal=True``, output projection."""

    def __init__(self, cfg: Gpt2Config) -> None:
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of heads {cfg.heads}")
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, head_dim)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Gpt2Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) with GPT-2's tanh GELU."""

    def __init__(self, cfg: Gpt2Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp), nn.GELU(approximate="tanh"),
                                 nn.Linear(cfg.mlp, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Gpt2(nn.Module):
    """A GPT-2-shaped decoder-only LM in plain torch.nn: token and learned position embeddings, pre-LN blocks, a
    final LayerNorm and an LM head tied to the token embedding (as GPT-2's): token ids (b, t) -> logits (b, t, vocab).

    No buffers, so DDP has nothing to broadcast before each forward. Weights are initialised as GPT-2's (normal,
    std 0.02, zero biases), which keeps the random-token loss and its gradients in a realistic range.
    """

    def __init__(self, cfg: Gpt2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Gpt2Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, one gradient, one place in DDP's buckets
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.cfg.context:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than the context {self.cfg.context}")
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))


@dataclasses.dataclass
class Workload:
    """What the benchmark trains: the model every variant copies, its loss, and how the results name it."""

    model: nn.Module
    loss: Callable[[nn.Module], torch.Tensor]
    """The loss of one step of the given (DDP) model on the workload's fixed batch; the caller runs backward."""
    title: str
    """The RESULTS.md section's title."""
    stem: str
    """The saved JSON's name: ``ddp_step`` for the MLP (as before), ``ddp_step_gpt2`` for GPT-2."""
    env: Dict[str, Any]
    """What the output's env adds: model, parameters, batch and, for GPT-2, tokens and autocast."""


def make_workload(model: str, small: bool, batch: Optional[int], seq: Optional[int], device: torch.device,
                  world: int) -> Workload:
    """Build ``model`` ("mlp" or "gpt2") on ``device`` with its batch (random inputs, seed 0)."""
    torch.manual_seed(0)
    if model == "mlp":
        width, blocks = (128, 2) if small else (1024, 12)
        batch = 64 if batch is None else batch
        base = make_model(width, blocks).to(device)
        params = sum(q.numel() for q in base.parameters())
        x = torch.randn(batch, width, device=device)
        title = f"bench/ddp_step.py (world size {world}, {params / 1e6:.1f}M parameters, batch {batch})"
        return Workload(base, lambda m: m(x).float().square().mean(), title, "ddp_step",
                        {"model": "mlp", "parameters": params, "batch": batch})
    if model != "gpt2":
        raise ValueError(f"unknown model {model}")
    cfg = GPT2_SMOKE if small else GPT2_SMALL
    batch = (2 if small else 8) if batch is None else batch
    seq = cfg.context if seq is None else seq
    if not 0 < seq <= cfg.context:
        raise ValueError(f"--seq {seq}: the model's context is {cfg.context} tokens")
    base = Gpt2(cfg).to(device)
    params = sum(q.numel() for q in base.parameters())  # the tied head counts once, as in GPT-2's 124M
    tokens = torch.randint(cfg.vocab, (batch, seq + 1), device=device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    autocast = device.type == "cuda"

    def loss(m: nn.Module) -> torch.Tensor:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = m(inputs)
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    precision = "bf16 autocast" if autocast else "float32"
    title = (f"bench/ddp_step.py --model gpt2 (world size {world}, {params / 1e6:.1f}M parameters, batch {batch} x "
             f"{seq} tokens, {precision})")
    return Workload(base, loss, title, "ddp_step_gpt2",
                    {"model": "gpt2", "parameters": params, "batch": batch, "seq": seq,
                     "gpt2_config": dataclasses.asdict(cfg), "tied_embeddings": True,
                     "autocast": "bfloat16" if autocast else None})


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
    elif variant == "triton_hook_bf16_fp32sum":  # bf16 on the wire, float32 sums (all-to-all + all-gather)
        ddp_triton.register(ddp, comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)
    elif variant == "triton_hook_fp8":  # block-scaled E4M3 with error feedback
        ddp_triton.register(ddp, comm_dtype=torch.float8_e4m3fn)
    elif variant == "triton_hook_fp8_no_ef":
        ddp_triton.register(ddp, comm_dtype=torch.float8_e4m3fn, error_feedback=False)
    elif variant != "no_hook":
        raise ValueError(f"unknown variant {variant}")
    return None


def make_ddp(base: nn.Module, device: torch.device, gabv: bool = False) -> DDP:
    """A DDP model around a copy of ``base`` (the variants never share parameters or buckets)."""
    return DDP(copy.deepcopy(base), device_ids=[device.index] if device.type == "cuda" else None,
               gradient_as_bucket_view=gabv)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA only: CPU work is done when the call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(ddp: DDP, loss: Callable[[nn.Module], torch.Tensor], opt: torch.optim.Optimizer,
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


def time_steps(ddp: DDP, loss: Callable[[nn.Module], torch.Tensor], steps: int, warmup: int, device: torch.device,
               clip: Optional[Callable[[], None]] = None) -> List[float]:
    """Milliseconds of each of ``steps`` synchronised steps, after ``warmup`` untimed ones."""
    step = make_step(ddp, loss, torch.optim.SGD(ddp.parameters(), lr=1e-4), clip)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


# ---- profiling -------------------------------------------------------------------------------------------------------

STEP_RANGE = "ddp_step.step"
FORWARD_RANGE = "ddp_step.forward"
BACKWARD_RANGE = "ddp_step.backward"
#: The range this script puts around every comm hook's call in --profile (torch's hooks too).
HOOK_RANGE = re.compile(r"^ddp_step\.hook bucket (\d+)$")
#: triton_hook's own ranges (ddp_triton/runtime/telemetry.py): pack, the collective phase(s), unpack; the float32
#: sums' exchange also has a local "reduce" between its all-to-all and all-gather.
TRITON_RANGE = re.compile(r"^ddp_triton\.(\w+) bucket (\d+) \(")
#: The phases of TRITON_RANGE that are a collective's call.
COLLECTIVE_PHASES = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter", "collective")
#: Collective calls through the dispatcher (ProcessGroup.allreduce, dist.all_reduce, DDP's reducer).
COLLECTIVE_OP = "c10d::"
#: DDP's own ranges: the forward's, and the reducer's (gradient copies into and out of the buckets, ...).
DDP_RANGE = re.compile(r"^(DistributedDataParallel|torch\.distributed\.ddp|torch::distributed::reducer)")
#: Trace categories of work on a GPU stream (not "gpu_user_annotation", which only mirrors host ranges there).
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
#: Host-side launch records, whose "correlation" names the GPU event they launched.
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")

Interval = Tuple[float, float]


def hook_in_range(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` inside a profiler range ``ddp_step.hook bucket N``: the host time of the whole call, for any hook.

    ``functools.wraps`` keeps the name and (through ``__wrapped__``) the signature DDP checks at registration."""

    @functools.wraps(hook)
    def ranged(state: Any, bucket: Any) -> Any:
        with torch.profiler.record_function(f"ddp_step.hook bucket {bucket.index()}"):
            return hook(state, bucket)

    return ranged


def range_hooks(ddp: DDP) -> None:
    """Make every comm hook registered on ``ddp`` from now on (``ddp_triton.register``'s too) run in
    ``hook_in_range``: DDP's reducer takes one hook, so it must be wrapped before it is registered."""
    register_comm_hook = ddp.register_comm_hook

    def register_in_range(state: object, hook: Callable[..., Any]) -> None:
        register_comm_hook(state, hook_in_range(hook))

    ddp.register_comm_hook = register_in_range  # type: ignore[method-assign]


def start_profiler(device: torch.device, steps: int) -> Tuple[Any, bool, Optional[str]]:
    """A started ``torch.profiler.profile`` (CPU, and CUDA on a GPU) that records ``steps`` steps after one step of
    its own warm-up (the first step under a profiler pays for its set-up; ``prof.step()`` after each step), on every
    thread where this torch can.

    Returns (profiler, whether it records every thread, a note when it does not). Without every thread, what gloo
    runs on its own thread (unpacks completing late) is missing from the trace."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    options: Dict[str, Any] = {"activities": activities,
                               "schedule": torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)}
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # torch before profile_all_threads
        config = None
    if config is not None:
        prof = torch.profiler.profile(experimental_config=config, **options)
        try:
            prof.start()
            return prof, True, None
        except RuntimeError as e:
            note = f"the profiler refused to record every thread ({e}); recorded the calling thread's only"
    else:
        note = f"torch {torch.__version__} cannot record every thread: ranges on other threads are missing"
    prof = torch.profiler.profile(**options)
    prof.start()
    return prof, False, note


def safe_name(*parts: Any) -> str:
    """A file name of letters, digits, '.', '_' and '-' only, from ``parts`` joined by '-'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", "-".join(str(p) for p in parts))


def profile_variant(ddp: DDP, loss: Callable[[nn.Module], torch.Tensor], steps: int, warmup: int,
                    device: torch.device, trace_path: Path, clip: Optional[Callable[[], None]] = None
                    ) -> Tuple[bool, Optional[str]]:
    """Run ``warmup`` steps, then record ``steps`` synchronised steps (each in a ``ddp_step.step`` range, after the
    profiler's own warm-up step) and write the chrome trace to ``trace_path``. Returns (every thread recorded, a
    note when not)."""
    step = make_step(ddp, loss, torch.optim.SGD(ddp.parameters(), lr=1e-4), clip, ranges=True)
    for _ in range(warmup):
        step()
    sync(device)
    prof, all_threads, note = start_profiler(device, steps)
    try:
        for _ in range(1 + steps):  # the profiler's warm-up step, then the recorded ones
            with torch.profiler.record_function(STEP_RANGE):
                step()
                sync(device)  # inside the step's range: its GPU work ends within it
            prof.step()
    finally:
        prof.stop()
    prof.export_chrome_trace(str(trace_path))
    return all_threads, note


def _span(event: Dict[str, Any]) -> Interval:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def merge(intervals: Iterable[Interval]) -> List[Interval]:
    """Sorted, non-overlapping union of ``intervals``."""
    out: List[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    """Length of the union of ``intervals``."""
    return sum(end - start for start, end in merge(intervals))


def overlap(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def idle_gaps(events: Sequence[Interval]) -> List[Interval]:
    """The gaps between consecutive events of one stream (by start; an event inside an earlier one is no gap)."""
    gaps: List[Interval] = []
    end: Optional[float] = None
    for start, stop in sorted(events):
        if end is not None and start > end:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


def _within(events: List[Tuple[float, float, Dict[str, Any]]], starts: List[float], window: Interval
            ) -> List[Tuple[float, float, Dict[str, Any]]]:
    """The events (sorted by start, ``starts`` their starts) that start inside ``window``."""
    return events[bisect.bisect_left(starts, window[0]):bisect.bisect_right(starts, window[1])]


def backward_gpu_span(stream: Sequence[Tuple[float, float, Dict[str, Any]]], launches: Dict[Any, float],
                      backward: Interval, step: Interval) -> Interval:
    """Where the backward's work runs on ``stream`` (GPU events, sorted by start): from the first event launched
    during the ``backward`` host range to the first event launched after it within the ``step`` (the clip's or the
    optimizer's; in stream order nothing of the backward runs later), else the step's end. Events without a launch
    record (a launch path the profiler does not see) then still count by where they ran. Without any launch record
    in the backward, the host range itself (the GPU's clock is the profiler's common one)."""
    first: Optional[float] = None
    end = step[1]
    for start, _, event in stream:
        at = launches.get(event.get("args", {}).get("correlation"))
        if at is None:
            continue
        if backward[0] <= at <= backward[1]:
            first = start if first is None else min(first, start)
        elif backward[1] < at <= step[1]:
            end = min(end, start)
    if first is None:
        return backward
    return first, end


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def analyse_trace(trace: Dict[str, Any]) -> Dict[str, Any]:
    """Per bucket and per step, from a chrome trace that ``profile_variant`` wrote (a dict: its JSON).

    Returns ``{"steps": n, "buckets": [row per bucket index], "step": {...}, "ddp_ranges": {name: us per step},
    "gpu": bool}``: every time in microseconds, means over the trace's ``ddp_step.step`` ranges (a bucket's mean
    over the steps it appears in). GPU fields are None where the trace holds no GPU events (CPU runs).

    Host times are the ranges' durations on whichever thread ran them (every thread where the profiler recorded
    them all). GPU idle: on the compute stream (the stream with the most non-NCCL events), the backward's span
    (``backward_gpu_span``: launch records matched to GPU events through their "correlation"); its idle time is the
    sum of the gaps between consecutive events that start in that span. A bucket's ``gpu_idle_in_hook_us`` is the
    part of those gaps that fell while the host was in that bucket's hook (its hook range and unpack, or for no hook
    its collective call), on the profiler's common clock. ``other_us``: triton_hook phases that are neither pack,
    collective nor unpack (the float32 sums' local reduce).
    """
    host: List[Tuple[float, float, Dict[str, Any]]] = []
    gpu: List[Tuple[float, float, Dict[str, Any]]] = []
    launches: Dict[Any, float] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "ts" not in e:
            continue
        cat = e.get("cat")
        start, end = _span(e)
        if cat in GPU_CATEGORIES:
            gpu.append((start, end, e))
        elif cat != "gpu_user_annotation":
            host.append((start, end, e))
            if cat in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
                launches[e["args"]["correlation"]] = start
    host.sort(key=lambda t: t[0])
    host_starts = [t[0] for t in host]

    compute: List[Tuple[float, float, Dict[str, Any]]] = []
    stream_name: Optional[str] = None
    if gpu:
        counts: Dict[Tuple[Any, Any], int] = {}
        for _, _, e in gpu:
            if not str(e.get("name", "")).lower().startswith("nccl"):
                key = (e.get("pid"), e.get("tid"))
                counts[key] = counts.get(key, 0) + 1
        if counts:
            key = max(counts, key=counts.__getitem__)
            stream_name = f"device {key[0]} {key[1]}"
            compute = sorted((t for t in gpu if (t[2].get("pid"), t[2].get("tid")) == key), key=lambda t: t[0])
    compute_starts = [t[0] for t in compute]

    steps = [(s, e) for s, e, ev in host if ev.get("name") == STEP_RANGE]
    per_bucket: Dict[int, List[Dict[str, Optional[float]]]] = {}
    per_step: List[Dict[str, Optional[float]]] = []
    ddp_ranges: Dict[str, float] = {}
    for window in steps:
        events = _within(host, host_starts, window)
        backward = next(((s, e) for s, e, ev in events if ev.get("name") == BACKWARD_RANGE), window)

        # Host ranges per bucket.
        hooks: Dict[int, List[Tuple[float, float, Any]]] = {}
        phases: Dict[int, Dict[str, List[Interval]]] = {}
        collective_calls: List[Tuple[float, float, Any]] = []
        for s, e, ev in events:
            name = str(ev.get("name", ""))
            m = HOOK_RANGE.match(name)
            if m:
                hooks.setdefault(int(m.group(1)), []).append((s, e, ev.get("tid")))
                continue
            m = TRITON_RANGE.match(name)
            if m:
                phase = m.group(1)
                if phase not in ("pack", "unpack"):
                    phase = "collective" if phase in COLLECTIVE_PHASES else "other"
                phases.setdefault(int(m.group(2)), {}).setdefault(phase, []).append((s, e))
                continue
            if name.startswith(COLLECTIVE_OP):
                collective_calls.append((s, e, ev.get("tid")))
            elif DDP_RANGE.match(name):
                ddp_ranges[name] = ddp_ranges.get(name, 0.0) + (e - s)

        def calls_inside(s: float, e: float, tid: Any) -> List[Interval]:
            return [(cs, ce) for cs, ce, ct in collective_calls if ct == tid and s <= cs and ce <= e]

        buckets: Dict[int, Dict[str, Any]] = {}
        for index in sorted(set(hooks) | set(phases)):
            ranges = phases.get(index, {})
            spans = hooks.get(index, [])
            if "collective" in ranges:
                collective: Optional[float] = length(ranges["collective"])
            else:
                inside = [iv for s, e, tid in spans for iv in calls_inside(s, e, tid)]
                collective = length(inside) if inside else None
            host_intervals = [(s, e) for s, e, _ in spans] or [iv for ivs in ranges.values() for iv in ivs]
            host_intervals += ranges.get("unpack", [])
            buckets[index] = {
                "hook_us": sum(e - s for s, e, _ in spans) if spans else None,
                "pack_us": sum(e - s for s, e in ranges["pack"]) if "pack" in ranges else None,
                "collective_us": collective,
                "unpack_us": sum(e - s for s, e in ranges["unpack"]) if "unpack" in ranges else None,
                "other_us": sum(e - s for s, e in ranges["other"]) if "other" in ranges else None,
                "host": merge(host_intervals),
            }
        if not buckets:  # no hook: DDP's reducer calls the collective itself, bucket by bucket in index order
            calls = [c for c in collective_calls if backward[0] <= c[0] <= backward[1]]
            top = [c for c in calls
                   if not any(o is not c and o[2] == c[2] and o[0] <= c[0] and c[1] <= o[1] for o in calls)]
            for index, (s, e, _) in enumerate(sorted(top, key=lambda c: c[0])):
                buckets[index] = {"hook_us": None, "pack_us": None, "collective_us": e - s, "unpack_us": None,
                                  "other_us": None, "host": [(s, e)]}

        # The compute stream during the backward.
        gaps: Optional[List[Interval]] = None
        busy = events_in_backward = None
        if compute:
            span = backward_gpu_span(compute, launches, backward, window)
            running = [(s, e) for s, e, _ in _within(compute, compute_starts, span) if s < span[1]]
            gaps = idle_gaps(running)
            busy, events_in_backward = length(running), float(len(running))
        for index, row in buckets.items():
            row["gpu_idle_in_hook_us"] = overlap(merge(gaps), row.pop("host")) if gaps is not None else None
            per_bucket.setdefault(index, []).append(row)

        def bucket_sum(field: str) -> Optional[float]:
            values = [r[field] for r in buckets.values() if r[field] is not None]
            return sum(values) if values else None

        per_step.append({
            "step_ms": (window[1] - window[0]) / 1e3,
            "backward_us": backward[1] - backward[0],
            "buckets": float(len(buckets)),
            "hook_us": bucket_sum("hook_us"),
            "collective_us": bucket_sum("collective_us"),
            "gpu_busy_backward_us": busy,
            "gpu_idle_backward_us": sum(e - s for s, e in gaps) if gaps is not None else None,
            "gpu_gaps_backward": float(len(gaps)) if gaps is not None else None,
            "gpu_events_backward": events_in_backward,
        })

    fields = ("hook_us", "pack_us", "collective_us", "unpack_us", "other_us", "gpu_idle_in_hook_us")
    rows = [{"bucket": index, **{f: _mean([r[f] for r in seen]) for f in fields}, "steps": len(seen)}
            for index, seen in sorted(per_bucket.items())]
    step_fields = per_step[0].keys() if per_step else ()
    summary = {f: _mean([s[f] for s in per_step]) for f in step_fields}
    summary["compute_stream"] = stream_name
    return {"steps": len(steps), "buckets": rows, "step": summary, "gpu": bool(compute),
            "ddp_ranges": {name: total / len(steps) for name, total in sorted(ddp_ranges.items())}}


BUCKET_HEADERS = ["bucket", "hook us", "pack us", "collective us", "unpack us", "GPU idle in hook us"]
STEP_HEADERS = ["variant", "bucket view", "buckets", "step ms (profiled)", "backward us", "hook us/step",
                "collective us/step", "GPU busy bwd us", "GPU idle bwd us", "GPU gaps bwd"]


def _gpu_cell(value: Optional[float], gpu: bool) -> Any:
    return value if gpu else "n/a"


def bucket_table(result: Dict[str, Any]) -> str:
    """The per-bucket table of one profiled variant (GPU column "n/a" without CUDA events)."""
    return format_table(BUCKET_HEADERS, [[r["bucket"], r["hook_us"], r["pack_us"], r["collective_us"],
                                          r["unpack_us"], _gpu_cell(r["gpu_idle_in_hook_us"], result["gpu"])]
                                         for r in result["buckets"]])


def step_table(results: Sequence[Dict[str, Any]]) -> str:
    """One row per profiled variant: the step's totals and the compute stream's idle time in the backward."""
    rows = []
    for r in results:
        s, gpu = r["step"], r["gpu"]
        rows.append([r["variant"], r["gradient_as_bucket_view"], s.get("buckets"), s.get("step_ms"),
                     s.get("backward_us"), s.get("hook_us"), s.get("collective_us"),
                     _gpu_cell(s.get("gpu_busy_backward_us"), gpu), _gpu_cell(s.get("gpu_idle_backward_us"), gpu),
                     _gpu_cell(s.get("gpu_gaps_backward"), gpu)])
    return format_table(STEP_HEADERS, rows)


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
    """The whole step with triton_hook captured in one CUDA graph, by torch's recipe for DDP (README, "The whole
    step in one CUDA graph"): DDP built on the capture stream, eager warm-up, then capture; returns the replay."""
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


def time_calls(call: Callable[[], None], steps: int, warmup: int, device: torch.device) -> List[float]:
    """Milliseconds of each of ``steps`` synchronised calls (graph replays), after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        call()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def run_benchmark(args: argparse.Namespace, work: Workload, device: torch.device, views: Sequence[bool],
                  backend: str, notes: List[str]) -> List[Dict[str, Any]]:
    """Median step time per variant and bucket view, the variants taking turns in rounds."""
    rows: List[Dict[str, Any]] = []
    for gabv in views:
        models = []
        for variant in variants_to_run(args.variants, backend, notes, device, work.env["model"]):
            if variant in GRAPH_VARIANTS:
                replay = captured_step(work.model, work.loss, device, gabv, GRAPH_VARIANTS[variant])
                timer = functools.partial(time_calls, replay)
            else:
                ddp = make_ddp(work.model, device, gabv)
                clip = register(ddp, variant, notes)
                timer = functools.partial(time_steps, ddp, work.loss, clip=clip)
            models.append((variant, timer, []))
        # Rounds, each variant in turn: a slow patch of the machine (clocks, another tenant) hits them all alike.
        for round_ in range(args.rounds):
            for _, timer, times in models:
                times += timer(max(1, args.steps // args.rounds), args.warmup if round_ == 0 else 2, device)
        for variant, _, times in models:
            rows.append({"variant": variant, "gradient_as_bucket_view": gabv, "median_ms": statistics.median(times),
                         "min_ms": min(times), "steps": len(times)})
        del models
        if device.type == "cuda":
            torch.cuda.empty_cache()

    baseline = {r["gradient_as_bucket_view"]: r["median_ms"] for r in rows if r["variant"] == "no_hook"}
    for r in rows:
        base_ms = baseline.get(r["gradient_as_bucket_view"])
        r["vs_no_hook"] = r["median_ms"] / base_ms if base_ms else None
    return rows


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
            all_threads, note = profile_variant(ddp, work.loss, args.steps, args.warmup, device, trace, clip)
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
    p.add_argument("--batch", type=int, default=None, help="default: 64 (mlp), 8 (gpt2), 2 (gpt2 --small)")
    p.add_argument("--seq", type=int, default=None, help="gpt2: tokens per sequence (default: the context, 1024; "
                                                          "32 with --small)")
    p.add_argument("--small", action="store_true",
                   help="a CPU smoke run: the MLP at width 128 and 2 blocks, GPT-2 at 2 layers and d_model 64")
    p.add_argument("--bucket-view", choices=("both", "off", "on"), default="both",
                   help="gradient_as_bucket_view settings to run")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--profile", action="store_true",
                   help="profile each variant instead of timing it: chrome traces and per-bucket host times; "
                        "e.g. --variants no_hook,triton_hook_bf16")
    p.add_argument("--no-results", action="store_true", help="do not append to bench/RESULTS.md")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 5 if args.profile else 100
    if args.model == "mlp" and args.seq is not None:
        p.error("--seq applies to --model gpt2")
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be at least 1")

    if any(v in GRAPH_VARIANTS for v in args.variants.split(",")):
        # torch's recipe for capturing DDP in a CUDA graph: NCCL's async error handling off, before the group exists
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    device = init()
    rank, world = dist.get_rank(), dist.get_world_size()
    work = make_workload(args.model, args.small, args.batch, args.seq, device, world)
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
            table = format_table(["variant", "bucket view", "median ms", "min ms", "x no hook (same view)"],
                                 [[r["variant"], r["gradient_as_bucket_view"], r["median_ms"], r["min_ms"],
                                   r["vs_no_hook"]] for r in rows])
            path = save_json(work.stem, {"env": env, "rows": rows, "notes": notes}, args.out_dir)
            print(f"{env}\n\n{table}\n\nsaved {path}")
            for n in sorted(set(notes)):
                print(n)
            if not args.no_results and device.type == "cuda":
                append_results(work.title, env, [table], sorted(set(notes)))
    leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
