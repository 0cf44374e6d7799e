"""Several ranks on one GPU: the hook at world size 2 and 4 with CUDA tensors over gloo, against the same job on CPU
tensors, and a peer's death named with CUDA tensors.

Tier: GPU (skipped without CUDA), gloo multi-process: every rank's model on cuda:0 and one gloo group (NCCL cannot
put two ranks on one GPU), real processes from ``dist_utils``. What this runs that world size 1 over NCCL does not:
gloo's CUDA futures and the stream their callbacks run on (the unpack after a collective), the staged exchanges'
order of kernels and collectives (bf16 + fp32 sums, FP8, two-level), chunks, CUDA events (``timing=True``) and the
statistics. Layouts: 2 ranks and 4 ranks flat, and 2 nodes x 2 ranks two-level (each worker told its node as
torchrun tells it, ``GROUP_RANK``).

- **Bits.** Each case trains the same job three times in every worker: on CPU tensors (the torch path and the C FP8
  passes), on CUDA tensors (the compiled kernels), and on CUDA tensors with ``timing=True, grad_stats=True``. The
  model's gradients are its inputs exactly (``Planes``), so every path hands the hook the same bits; the averaged
  gradients of every step, the bucket layouts and the FP8 residuals must be bit for bit the CPU job's. docs/formats.md
  promises it: the same bits on every path for every value but NaN (none here), FP8 included; gloo sums CUDA
  tensors on the host, as it sums CPU tensors.
- **A peer's death.** One model per case, each on its own group, trained step by step until rank 1 kills itself:
  every survivor's step must fail within seconds with the message that names the collective, the bucket and its
  format and says a peer is gone (as ``tests/dist/runtime/test_failures.py`` checks on CPU tensors).

A collective gloo cannot run on CUDA tensors in this torch build (which ones varies by build) is found in the
workers by running it once, tiny, before any case; a case that needs one is skipped with the backend's words. One
set of processes runs every case of a layout (process starts and kernel compiles dominate); each case is a test of
its own, reading that run's verdicts. ``run_bits(layout, device)`` and ``run_peer_death(layout, device)`` take the
device as a parameter: on ``"cpu"`` the same code runs on a machine without a GPU (CPU against CPU).
"""

from __future__ import annotations

import functools
import json
import math
import os
import queue
import re
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_triton.runtime.chunks import CHUNK_BYTES_ENV
from ddp_triton.runtime.exchange import ChunkedExchange
from ddp_helpers import LOST_PEER, peer_death_problem
from dist_utils import WorkerError, call_as_the_test_left_off, run_workers, snapshot, start, worker_context

pytestmark = pytest.mark.gpu

LOCAL = 2  # ranks per node in the two-level layout
STEPS = 4  # DDP rebuilds its buckets after the first step: three steps on the rebuilt ones, FP8 residuals carried
BUCKET_CAP_MB = 0.004  # about 1k float32 elements: three buckets of 2000, 12,718 and 5,018 after the rebuild
CHUNK_BYTES = 8192  # bytes of a bucket per chunk: about 16 FP8 blocks, 3 to 10 chunks a bucket here
SIZES = (5000, 17, 1, 3 * 4096 + 1, 300, 129, 2000)  # 19,736 elements; most end off the 128-element block grid


class Case(NamedTuple):
    wire: str
    """The wire format's name, as ``state.wire.name`` and the failure message say it."""
    options: dict
    chunked: bool = False

    @property
    def id(self) -> str:
        """The case's name in test ids and verdicts: "two-level-fp8e4m3+ef-chunked"."""
        return self.wire.replace(" ", "-") + ("-chunked" if self.chunked else "")


FP8 = torch.float8_e4m3fn
FLAT = [Case("fp32", dict(comm_dtype=torch.float32)),
        Case("bf16", dict(comm_dtype=torch.bfloat16)),
        Case("fp16", dict(comm_dtype=torch.float16)),
        Case("bf16+fp32sum", dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)),
        Case("fp8e4m3+ef", dict(comm_dtype=FP8)),
        Case("fp8e4m3+ef", dict(comm_dtype=FP8), chunked=True)]
TWO_LEVEL = [Case("two-level " + wire, dict(options, hierarchical=True), chunked)
             for wire, options in (("bf16", dict(comm_dtype=torch.bfloat16)),
                                   ("bf16+fp32sum", dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)),
                                   ("fp8e4m3+ef", dict(comm_dtype=FP8)))
             for chunked in (False, True)]
LAYOUTS = {"2-ranks": (2, FLAT), "4-ranks": (4, FLAT), "2x2-nodes": (2 * LOCAL, TWO_LEVEL)}

# A peer's death: rank 1 dies at this step (after DDP's rebuild and the FP8 residuals' move to the new buckets).
KILL_AT_STEP = 3
# A survivor's step must raise within this long of the peer's death (or of the step's start, for the cases it runs
# after the first): gloo sees the reset connection at once; the bound is test_failures.py's, for a loaded machine.
FAIL_SECONDS = 15
GROUP_TIMEOUT = timedelta(seconds=60)
PROBE_TIMEOUT = timedelta(seconds=30)  # a probe that hangs (one rank refused it, the others wait) ends here
DEATH_LAYOUTS = {"2-ranks": (2, FLAT), "2x2-nodes": (2 * LOCAL, TWO_LEVEL)}


# ---- what gloo can carry with CUDA tensors ---------------------------------------------------------------------------


def _probe_one(collective: str, dtype: torch.dtype, device: torch.device) -> None:
    """Run ``collective`` once on ``dtype`` tensors of ``device`` on a fresh group (a failure there leaves the
    others alone), as the hook calls it, and check what it gave."""
    from ddp_triton.runtime.nodes import reduce_scatter_single
    from ddp_triton.runtime.wire_exchanges import all_gather_into

    group = dist.new_group(timeout=PROBE_TIMEOUT)
    k, me = dist.get_world_size(group), dist.get_rank(group)
    if collective == "broadcast":  # DDP's own: the parameters at construction, the bucket order at its rebuild
        out = torch.full((3,), float(me), device=device).to(dtype)
        work, expected = dist.broadcast(out, 0, group=group, async_op=True), torch.zeros(3)
    elif collective == "all_reduce":
        out = torch.ones(k, device=device).to(dtype)
        work, expected = dist.all_reduce(out, group=group, async_op=True), torch.full((k,), float(k))
    elif collective == "all_to_all":
        out, send = torch.empty(k, dtype=dtype, device=device), torch.full((k,), float(me), device=device).to(dtype)
        work, expected = dist.all_to_all_single(out, send, group=group, async_op=True), torch.arange(k).float()
    elif collective == "all_gather":
        out, send = torch.empty(k, dtype=dtype, device=device), torch.full((1,), float(me), device=device).to(dtype)
        work, expected = all_gather_into(out, send, group=group, async_op=True), torch.arange(k).float()
    elif collective == "reduce_scatter":
        out = torch.empty(1, dtype=dtype, device=device)
        work, expected = reduce_scatter_single(out, torch.ones(k, device=device).to(dtype), group), torch.full((1,), k)
    else:
        raise ValueError(f"no probe for {collective}")
    work.get_future().wait()  # the hook waits on the future, not on the Work
    if not torch.equal(out.cpu().float(), expected.float()):
        raise RuntimeError(f"gave {out.cpu().tolist()}, expected {expected.tolist()}")


PROBES = [("broadcast", torch.float32), ("all_reduce", torch.float32), ("all_reduce", torch.bfloat16),
          ("all_reduce", torch.float16), ("all_to_all", torch.uint8), ("all_to_all", torch.bfloat16),
          ("all_gather", torch.uint8), ("all_gather", torch.bfloat16), ("all_gather", torch.float32),
          ("reduce_scatter", torch.float32)]


def probe_collectives(device: torch.device) -> Dict[str, Optional[str]]:
    """Each of ``PROBES`` by name ("all_to_all uint8"): None where it runs on ``device``'s tensors, else why not (the
    backend's words), agreed by every rank of the default group (a collective one rank refused fails on all); and
    under "node sum", the collective a two-level exchange sums a node's part with (as ``nodes.py`` decides: a
    reduce-scatter where it completes a future, else an all-reduce)."""
    from ddp_triton.runtime.nodes import _reduce_scatter_has_future

    said: Dict[str, Optional[str]] = {}
    for collective, dtype in PROBES:
        name = f"{collective} {str(dtype).replace('torch.', '')}"
        try:
            _probe_one(collective, dtype, device)
            said[name] = None
        except Exception as exc:  # noqa: BLE001 - whatever the backend raised is the reason it cannot
            said[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}"
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, said)
    agreed = {name: next((s[name] for s in everyone if s[name] is not None), None) for name in said}
    has_future = _reduce_scatter_has_future(dist.group.WORLD, dist.get_world_size())
    agreed["node sum"] = "reduce_scatter float32" if has_future else "all_reduce float32"
    return agreed


def needs(case: Case, world_size: int, node_sum: str) -> List[str]:
    """The collectives a case issues on its gradients' device (``probe_collectives``' names; ``node_sum``: its
    choice for a node's sum)."""
    comm = case.options["comm_dtype"]
    float32_sums = case.options.get("accumulate_dtype") == torch.float32
    flat_ranks = world_size // LOCAL if case.options.get("hierarchical") else world_size  # the cross hop's ranks
    if comm == FP8:  # all-to-all and all-gather of bytes; the residuals' re-slice at a new layout and state_dict's
        # gather: an all-reduce in the residuals' dtype (residuals.RESIDUAL_DTYPE, bfloat16)
        wanted = ["all_to_all uint8", "all_gather uint8", "all_reduce bfloat16"]
    elif float32_sums and flat_ranks > 2:
        wanted = ["all_to_all bfloat16", "all_gather bfloat16"]
    else:
        wanted = [f"all_reduce {str(comm).replace('torch.', '')}"]
    if case.options.get("hierarchical"):  # the node's sum of the bucket, and its all-gather
        wanted += [node_sum, "all_gather float32"]
    return ["broadcast float32", *wanted]


def cannot_carry(case: Case, world_size: int, probed: Dict[str, Optional[str]]) -> Optional[str]:
    """Why gloo cannot run ``case`` on these tensors (the first collective it cannot run), or None."""
    missing = [(name, probed[name]) for name in needs(case, world_size, probed["node sum"])
               if probed[name] is not None]
    return None if not missing else f"gloo cannot run {missing[0][0]} on these tensors here: {missing[0][1]}"


# ---- the job: gradients that are the data, so every path starts from the same bits ---------------------------------


class Planes(nn.Module):
    """Parameters of ``SIZES``; the output is sum_i (p_i * x_i).sum(), so each gradient is its slice of x exactly
    (times 1.0) on any device."""

    def __init__(self) -> None:
        super().__init__()
        self.planes = nn.ParameterList([nn.Parameter(torch.zeros(n)) for n in SIZES])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * part).sum() for p, part in zip(self.planes, x.split(SIZES)))


def inputs(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s gradients at ``step``: normal values scaled by 1e-4 to 1e2 by parameter, as gradients are."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.cat([torch.randn(n, generator=gen) * 10.0 ** (i % 7 - 4) for i, n in enumerate(SIZES)])


class Run(NamedTuple):
    grads: List[torch.Tensor]
    """Every step's averaged gradients, concatenated, on the CPU."""
    buckets: List[List[int]]
    """Every step's buckets, by their element counts."""
    residuals: Dict[str, torch.Tensor]
    """FP8 with error feedback: the state's residuals after the last step, by stage and parameter."""
    state: Any


def train(rank: int, world_size: int, case: Case, device: torch.device, timing: bool = False) -> Run:
    """STEPS backward passes of ``Planes`` under DDP with ``case``'s hook on ``device`` (no optimizer step: the
    gradients do not depend on the parameters); ``timing`` also turns on the statistics."""
    model = Planes().to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=BUCKET_CAP_MB,
              gradient_as_bucket_view=True)  # the unpack writes the gradients themselves, as the README sets DDP up
    os.environ[CHUNK_BYTES_ENV] = str(CHUNK_BYTES if case.chunked else 0)  # read when the state binds: here
    try:
        state = ddp_triton.register(ddp, profile=None, timing=timing, grad_stats=timing, **case.options)
    finally:
        del os.environ[CHUNK_BYTES_ENV]
    grads, buckets = [], []
    for step in range(STEPS):
        ddp.zero_grad()
        ddp(inputs(rank, step).to(device)).backward()
        grads.append(torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()]).to("cpu", copy=True))
        buckets.append(sorted(plan.buffer.numel() for plan in state.latest_pass()))
    residuals = {}
    if state.wire.error_feedback:
        saved = state.state_dict()
        residuals = {f"{stage} {name}": value.to("cpu", copy=True)
                     for stage in ("first_stage", "second_stage") for name, value in saved[stage].items()}
    return Run(grads, buckets, residuals, state)


def differences(expected: torch.Tensor, got: torch.Tensor, what: str) -> Optional[str]:
    """None if ``got`` has ``expected``'s bits, else where and by how much they differ."""
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return f"{what}: {got.dtype} {tuple(got.shape)} against the CPU's {expected.dtype} {tuple(expected.shape)}"
    same = expected.contiguous().view(torch.uint8).view(-1, expected.element_size()) == \
        got.contiguous().view(torch.uint8).view(-1, got.element_size())
    differ = (~same.all(dim=1)).nonzero().flatten()
    if differ.numel() == 0:
        return None
    i = int(differ[0])
    gap = (expected.double() - got.double()).abs().max().item()
    return (f"{what}: {differ.numel()} of {expected.numel()} elements differ, the first at {i} "
            f"({expected.reshape(-1)[i].item()!r} on CPU tensors, {got.reshape(-1)[i].item()!r} here), max |diff| "
            f"{gap:.3g}")


def compare(cpu: Run, other: Run, label: str) -> List[str]:
    """What differs between the CPU job and ``other`` (named ``label``)."""
    problems = []
    if cpu.buckets != other.buckets:
        problems.append(f"{label}: buckets of {other.buckets} elements per step, on CPU tensors {cpu.buckets}")
    for step, (a, b) in enumerate(zip(cpu.grads, other.grads)):
        problems.append(differences(a, b, f"{label}: step {step}'s averaged gradients"))
    if cpu.residuals.keys() != other.residuals.keys():
        problems.append(f"{label}: residuals of {sorted(other.residuals)}, on CPU tensors {sorted(cpu.residuals)}")
    for name, value in cpu.residuals.items():
        if name in other.residuals:
            problems.append(differences(value, other.residuals[name], f"{label}: residual {name}"))
    return [p for p in problems if p is not None]


def path_problems(run: Run, case: Case, label: str) -> List[str]:
    """Whether ``run`` took the path ``case`` names: its format (two-level where asked) and chunks where asked."""
    state, problems = run.state, []
    if state.wire.name != case.wire:
        problems.append(f"{label}: ran {state.wire.name!r}, not {case.wire!r}")
    chunked = [isinstance(plan.exchange, ChunkedExchange) for plan in state.latest_pass()]
    if case.chunked != any(chunked):
        problems.append(f"{label}: buckets in chunks {chunked}, asked for {'chunks' if case.chunked else 'none'}")
    return problems


def timing_problems(cpu: Run, timed: Run, device: torch.device) -> List[str]:
    """The timed run's telemetry and statistics: every bucket's pack, communication and unpack timed by the clock of
    ``device`` (CUDA events: each phase's end after its start in stream order), and the gradient norm of the last
    step that of the CPU job's averaged gradients."""
    summary, problems = timed.state.summary(), []
    clock = "cuda events" if device.type == "cuda" else "host perf_counter"
    if summary.clock != clock:
        problems.append(f"timed: clock {summary.clock!r}, expected {clock!r}")
    for b in summary.buckets:
        times = (b.pack_ms, b.comm_ms, b.unpack_ms)
        if not all(t is not None and math.isfinite(t) and t >= 0 for t in times):
            problems.append(f"timed: bucket {b.index}'s pack, comm, unpack ms {times}")
    expected = cpu.grads[-1].double().norm().item()
    norm, found_inf = timed.state.grad_norm().item(), timed.state.found_inf().item()
    # The unpack sums squares per bucket in float32 (per chunk, per part) where this sums in float64: over 20k values
    # a float32 summation order, a few ulps (1.2e-7 each), as tests/dist/runtime/test_grad_stats.py allows.
    if not math.isclose(norm, expected, rel_tol=1e-5) or found_inf != 0:
        problems.append(f"timed: grad_norm {norm!r} (float64 of the CPU job's gradients: {expected!r}), "
                        f"found_inf {found_inf}")
    return problems


def bits_worker(rank: int, world_size: int, layout: str, device: str, out_dir: str) -> None:
    """Every case of ``layout``: the job on CPU tensors, then on ``device``'s twice (plain; timed, with statistics),
    compared. Writes this rank's verdicts to ``out_dir/rank<rank>.json`` after each case, {case id: [status,
    detail]}: "ok", "unsupported" (detail: why) or "failed" (what differs, or the traceback: a case that raises
    ends the run, since its peers may be waiting in a collective)."""
    _, cases = LAYOUTS[layout]
    if layout == "2x2-nodes":
        os.environ["GROUP_RANK"] = str(rank // LOCAL)  # what torchrun tells each worker
    on = use_device(device)
    probed = probe_collectives(on)
    verdicts: Dict[str, Tuple[str, str]] = {}
    path = os.path.join(out_dir, f"rank{rank}.json")

    def save() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(verdicts, f)
        os.replace(path + ".tmp", path)

    for case in cases:
        reason = cannot_carry(case, world_size, probed)
        if reason is not None:
            verdicts[case.id] = ("unsupported", reason)
            save()
            continue
        try:
            cpu = train(rank, world_size, case, torch.device("cpu"))
            plain = train(rank, world_size, case, on)
            timed = train(rank, world_size, case, on, timing=True)
        except Exception:
            verdicts[case.id] = ("failed", traceback.format_exc())
            save()
            raise
        problems = [*path_problems(cpu, case, "CPU tensors"), *path_problems(plain, case, device),
                    *compare(cpu, plain, device), *compare(cpu, timed, f"{device}, timed"),
                    *timing_problems(cpu, timed, on)]
        verdicts[case.id] = ("failed", "\n".join(problems)) if problems else ("ok", "")
        save()


def use_device(device: str) -> torch.device:
    """``device`` as this rank uses it: every rank on the one GPU, cuda:0, made current."""
    if device == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


# One set of workers' limit (its fork server's start excluded): on the 2-core CPU machine with device="cpu" a layout
# takes 2-7 s; on a GPU add a CUDA context per process and the first kernel compiles (tens of seconds, once). A hang
# ends here, and the layouts after it still run, rather than at the caller's limit.
RUN_SECONDS = 90


class Verdicts(NamedTuple):
    by_case: Dict[str, Dict[int, Tuple[str, str]]]
    """Case id -> rank -> (status, detail), for the ranks that got to the case."""
    error: Optional[str]
    """What ended the run early, if anything did."""


@functools.lru_cache(maxsize=None)
def run_bits(layout: str, device: str = "cuda") -> Verdicts:
    """Every case of ``layout`` on ``device``, in one set of workers, once per session (a failure included: the
    cases after it have no verdict, and say why)."""
    world_size, _ = LAYOUTS[layout]
    by_case: Dict[str, Dict[int, Tuple[str, str]]] = {}
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            run_workers(bits_worker, world_size, layout, device, out_dir, timeout=RUN_SECONDS)
            error = None
        except WorkerError as exc:
            error = str(exc)
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    for case, (status, detail) in json.load(f).items():
                        by_case.setdefault(case, {})[rank] = (status, detail)
    return Verdicts(by_case, error)


def check_verdicts(run: Verdicts, case: Case, world_size: int) -> None:
    """Skip where gloo cannot carry ``case``; fail where a rank found a difference or did not get to it."""
    verdicts = run.by_case.get(case.id, {})
    unsupported = [detail for status, detail in verdicts.values() if status == "unsupported"]
    if unsupported:
        pytest.skip(unsupported[0])
    failed = [f"rank {rank}: {detail}" for rank, (status, detail) in sorted(verdicts.items()) if status != "ok"]
    assert not failed, "\n".join(failed)
    missing = sorted(set(range(world_size)) - set(verdicts))
    assert not missing, f"ranks {missing} did not get to this case:\n{run.error}"


@pytest.mark.parametrize("layout, case", [pytest.param(layout, case, id=f"{layout}-{case.id}")
                                          for layout, (_, cases) in LAYOUTS.items() for case in cases])
def test_cuda_ranks_average_to_the_cpu_bits(layout, case):
    check_verdicts(run_bits(layout), case, LAYOUTS[layout][0])


# ---- a peer's death --------------------------------------------------------------------------------------------------


def peer_death_worker(rank: int, world_size: int, layout: str, device: str, store_path: str, kill_path: str,
                      results: Any) -> None:
    """One model per case of ``layout`` on ``device``, each on its own group, a step of each in turn, until rank 1
    kills itself at KILL_AT_STEP; then report, per case, when and how that step failed here (or why it did not
    run), as (rank, case id, status, step, seconds, message); then (rank, "", "done", ...). An error before the
    kill is reported as status "error" with its traceback."""
    try:
        models = _death_models(rank, world_size, layout, device, store_path, results)
    except Exception:  # everything before the kill goes back to the test
        results.put((rank, "", "error", None, None, traceback.format_exc()))
        models = None
    if models is not None:
        ddps, on = models
        x, y = torch.randn(4, 8, device=on), torch.randn(4, 4, device=on)
        failed: Dict[str, Tuple[int, float, str]] = {}
        for step in range(KILL_AT_STEP + 2):
            if rank == 1 and step == KILL_AT_STEP:
                with open(kill_path, "w") as f:
                    f.write(repr(time.time()))
                    f.flush()
                    os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)  # a peer dies mid-training, without a word
            for name, (ddp, opt) in ddps.items():
                if name in failed:
                    continue
                started = time.time()
                try:
                    opt.zero_grad()
                    nn.functional.mse_loss(ddp(x), y).backward()
                    opt.step()
                    if on.type == "cuda":
                        torch.cuda.synchronize(on)  # a failure the stream would meet later is this step's
                except Exception as exc:  # what we want after the kill: the collective's error
                    died = float(open(kill_path).read()) if os.path.exists(kill_path) else float("nan")
                    failed[name] = (step, time.time() - max(started, died), f"{type(exc).__name__}: {exc}")
        for name in ddps:
            step, seconds, message = failed.get(name, (None, None, ""))
            results.put((rank, name, "ran", step, seconds, message[:1500]))
        results.put((rank, "", "done", None, None, ""))
    results.close()
    results.join_thread()
    os._exit(0)  # no teardown of groups whose peer is gone


def _death_models(rank: int, world_size: int, layout: str, device: str, store_path: str,
                  results: Any) -> Tuple[Dict[str, Tuple[DDP, Any]], torch.device]:
    """Join the group, probe what gloo carries, and build a DDP model and optimizer per case it can carry (the others
    reported "unsupported" on ``results``)."""
    _, cases = DEATH_LAYOUTS[layout]
    if layout == "2x2-nodes":
        os.environ["GROUP_RANK"] = str(rank // LOCAL)
    on = use_device(device)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size,
                            timeout=GROUP_TIMEOUT)
    probed = probe_collectives(on)
    ddps = {}
    for case in cases:
        reason = cannot_carry(case, world_size, probed)
        if reason is not None:
            results.put((rank, case.id, "unsupported", None, None, reason))
            continue
        group = dist.new_group(list(range(world_size)), timeout=GROUP_TIMEOUT)  # its failure is its own
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).to(on)
        ddp = DDP(model, process_group=group, bucket_cap_mb=0.001,
                  device_ids=[on.index] if on.type == "cuda" else None)
        os.environ[CHUNK_BYTES_ENV] = str(512 if case.chunked else 0)  # 420 elements: two or three chunks a bucket
        try:
            ddp_triton.register(ddp, profile=None, **case.options)
        finally:
            del os.environ[CHUNK_BYTES_ENV]
        ddps[case.id] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
    return ddps, on


class Deaths(NamedTuple):
    reports: Dict[Tuple[int, str], tuple]
    """(rank, case id) -> (status, step, seconds, message), from the survivors."""
    survivors: List[int]
    killed_exit: Optional[int]
    """Rank 1's exit code."""
    error: Optional[str]
    """What went wrong with the run itself (a crash, a hang, an error before the kill)."""


@functools.lru_cache(maxsize=None)
def run_peer_death(layout: str, device: str = "cuda") -> Deaths:
    """Every case of ``layout`` on ``device`` until rank 1 dies, once per session (a failed run included)."""
    world_size, _ = DEATH_LAYOUTS[layout]
    ctx = worker_context()
    results = ctx.Queue()
    survivors = [r for r in range(world_size) if r != 1]
    reports: Dict[Tuple[int, str], tuple] = {}
    error = None
    with tempfile.TemporaryDirectory() as tmp:
        store_path, kill_path = os.path.join(tmp, "store"), os.path.join(tmp, "killed")
        args = (world_size, layout, device, store_path, kill_path)
        procs = [ctx.Process(target=call_as_the_test_left_off,
                             args=(snapshot(peer_death_worker, (r, *args)), results), daemon=True)
                 for r in range(world_size)]
        start(procs)
        done: set = set()
        deadline = time.monotonic() + RUN_SECONDS
        try:
            while done != set(survivors) and error is None:
                try:
                    rank, name, status, step, seconds, message = results.get(timeout=1.0)
                except queue.Empty:
                    crashed = [r for r in survivors if r not in done and procs[r].exitcode not in (None, 0)]
                    if crashed:
                        error = f"survivors {crashed} died (exit codes {[procs[r].exitcode for r in crashed]})"
                    elif time.monotonic() > deadline:
                        error = (f"survivors {sorted(set(survivors) - done)} neither failed nor finished every case "
                                 f"within {RUN_SECONDS} s (hang); reported: {reports}")
                    continue
                if status == "error":
                    error = f"rank {rank} failed before the kill:\n{message}"
                elif status == "done":
                    done.add(rank)
                else:
                    reports[(rank, name)] = (status, step, seconds, message)
        finally:
            for p in procs:
                p.join(timeout=5 if error is None else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return Deaths(reports, survivors, procs[1].exitcode, error)


def check_peer_death(run: Deaths, case: Case) -> None:
    """Skip where gloo cannot carry ``case``; else every survivor's step must have failed at the kill, within
    FAIL_SECONDS, with the message that names the collective, the bucket and its format."""
    said = [run.reports.get((rank, case.id)) for rank in run.survivors]
    unsupported = [report[3] for report in said if report is not None and report[0] == "unsupported"]
    if unsupported:
        pytest.skip(unsupported[0])
    assert run.error is None, run.error
    assert run.killed_exit == -signal.SIGKILL, f"rank 1 ended with {run.killed_exit}, not killed"
    told = (rf"ddp_triton: (all_reduce|all_to_all|all_gather|reduce_scatter)( between nodes)? of bucket \d+ "
            rf"\({re.escape(case.wire)} wire\){', chunk [0-9]+ of [0-9]+' if case.chunked else ''} "
            rf"{re.escape(LOST_PEER)}.*The backend said: .*(peer|Connection)")
    problems = []
    for rank, report in zip(run.survivors, said):
        if report is None:
            problems.append(f"rank {rank}: no report")
            continue
        _, step, seconds, message = report
        problem = peer_death_problem(f"rank {rank}", step, seconds, message, told, KILL_AT_STEP, FAIL_SECONDS)
        if problem is not None:
            problems.append(problem)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("layout, case", [pytest.param(layout, case, id=f"{layout}-{case.id}")
                                          for layout, (_, cases) in DEATH_LAYOUTS.items() for case in cases])
def test_a_dead_peer_is_named_with_cuda_tensors(layout, case):
    check_peer_death(run_peer_death(layout), case)
