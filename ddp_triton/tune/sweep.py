"""Timing all-reduces, nccl-tests style: every (dtype, size, algorithm) on the default process group.

``run_sweep``: for each dtype, size and algorithm, ``warmup`` all-reduces, then ``iters`` all-reduces each timed
alone (CUDA events around each on the GPU, no host sync between them; wall clock around each on CPU). Every rank
takes its median; the row reports the slowest rank's median (an all-reduce is as slow as its slowest rank, as
nccl-tests reports the maximum over ranks). In-place, like DDP. One more all-reduce of ones then checks the sum.
Every rank follows rank 0's plan (``processes.agree_on_plan``): sizes, dtypes, algorithms, warmup and iterations.
``format_rows`` prints rows in nccl-tests' columns.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..dtypes import dtype_size, normalize_dtype
from ..machine.cost_model import busbw_factor
from ..runtime.algo_groups import collective_device, make_algorithm_groups
from .processes import agree_on_plan
from .progress import Progress


def _time_allreduce(buf: torch.Tensor, group: Any, warmup: int, iters: int) -> List[float]:
    """Per-iteration microseconds of in-place all-reduces of ``buf`` on ``group``."""
    for _ in range(warmup):
        dist.all_reduce(buf, group=group)
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            dist.all_reduce(buf, group=group)
            end.record()
        torch.cuda.synchronize(buf.device)
        return [s.elapsed_time(e) * 1e3 for s, e in events]
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def _sync(device: torch.device) -> None:
    """A one-element all-reduce on the default group: a barrier that needs no device argument on NCCL."""
    dist.all_reduce(torch.zeros(1, device=device))


def _check_sum(buf: torch.Tensor, group: Any, world: int) -> int:
    """All-reduce ones; count elements not equal to the world size (exact for world <= 256 even in bf16)."""
    buf.fill_(1)
    dist.all_reduce(buf, group=group)
    if world <= 256:
        return int(buf.ne(world).sum().item())
    return int(((buf.float() - world).abs() > world * 2.0 ** -6).sum().item())


def run_sweep(sizes: Sequence[int], algorithms: Union[Sequence[str], Mapping[str, Sequence[str]]],
              dtypes: Sequence[str], warmup: int = 5, iters: int = 20, progress: bool = True,
              groups: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Time every (dtype, size, algorithm) on the default group; every rank returns the same rows.

    ``algorithms``: one list for every dtype, or a list per dtype (NVLS cannot reduce 8-bit types). Every rank
    times rank 0's sizes, dtypes, algorithms, warmup and iters (``agree_on_plan``).
    Rows: ``bytes, algorithm, time_us, algbw_gbps, busbw_gbps, dtype, protocol (None)`` with the slowest rank's
    median. ``groups`` maps algorithm to process group (default: ``make_algorithm_groups`` of every algorithm
    timed). Raises RuntimeError on every rank if a sum check finds wrong elements.
    """
    dtypes = [normalize_dtype(d) for d in dtypes]
    if isinstance(algorithms, Mapping):
        given = {normalize_dtype(k): list(v) for k, v in algorithms.items()}
        per_dtype = {dt: given.get(dt, []) for dt in dtypes}
    else:
        per_dtype = {dt: list(algorithms) for dt in dtypes}
    agreed = agree_on_plan({"sizes": [int(s) for s in sizes], "dtypes": dtypes, "algorithms": per_dtype,
                            "warmup": int(warmup), "iters": int(iters)})
    sizes, dtypes, per_dtype = agreed["sizes"], agreed["dtypes"], agreed["algorithms"]
    warmup, iters = agreed["warmup"], agreed["iters"]
    if warmup < 0 or iters < 1:
        raise ValueError(f"need warmup >= 0 and iters >= 1, got {warmup}, {iters}")
    world = dist.get_world_size()
    rank = dist.get_rank()
    device = collective_device(dist.group.WORLD)
    if groups is None:
        groups = make_algorithm_groups({a for algs in per_dtype.values() for a in algs})
    plan = [(dt, s, a) for dt in dtypes for s in sizes if s >= dtype_size(dt) for a in per_dtype[dt]]
    bar = Progress(len(plan), enabled=progress and rank == 0)
    medians: List[float] = []
    wrong: List[float] = []
    for dt in dtypes:
        itemsize = dtype_size(dt)
        fitting = [s for s in sizes if s >= itemsize]
        if not fitting or not per_dtype[dt]:
            continue
        storage = torch.zeros(max(fitting) // itemsize, dtype=getattr(torch, dt), device=device)
        for s in fitting:
            buf = storage[: s // itemsize]
            for a in per_dtype[dt]:
                _sync(device)  # ranks start each point together
                buf.zero_()  # zeros stay zeros: no overflow however many iterations
                medians.append(statistics.median(_time_allreduce(buf, groups[a], warmup, iters)))
                wrong.append(float(_check_sum(buf, groups[a], world)))
                bar.step(f"{a} {dt} {s} B")
        del storage
    stats = torch.tensor(medians + wrong, dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    vals = stats.tolist()
    n = len(medians)
    slowest, worst = vals[:n], vals[n:]
    bad = [(plan[i], int(w)) for i, w in enumerate(worst) if w > 0]
    if bad:
        raise RuntimeError(f"all-reduce results wrong on some rank: {bad[:5]} ((dtype, bytes, algorithm), "
                           "wrong elements)")
    factor = busbw_factor(world)
    rows = []
    for (dt, s, a), t in zip(plan, slowest):
        t = max(t, 1e-3)  # a clock that rounds to 0 must not divide by 0
        alg = s / (t * 1e3)
        rows.append({"bytes": s, "algorithm": a, "time_us": t, "algbw_gbps": alg, "busbw_gbps": alg * factor,
                     "dtype": dt, "protocol": None})
    return rows


def format_rows(rows: Sequence[Dict[str, Any]], world_size: int) -> str:
    """nccl-tests' columns: size (B), count (elements), type, time (us), algbw (GB/s), busbw (GB/s); and the model's
    busbw when rows carry ``model_busbw_gbps``."""
    model = any(r.get("model_busbw_gbps") is not None for r in rows)
    extra = (f" {'model':>8}", f" {'(GB/s)':>8}") if model else ("", "")
    lines = [f"# {'size':>12} {'count':>12} {'type':>9} {'algorithm':>10} {'time':>10} {'algbw':>8} {'busbw':>8}"
             + extra[0],
             f"# {'(B)':>12} {'(elements)':>12} {'':>9} {'':>10} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}" + extra[1]]
    for r in rows:
        dt = r.get("dtype") or "?"
        count = r["bytes"] // dtype_size(dt) if dt != "?" else 0
        line = (f"  {r['bytes']:>12} {count:>12} {dt:>9} {r['algorithm']:>10} {r['time_us']:>10.2f} "
                f"{r['algbw_gbps']:>8.2f} {r['busbw_gbps']:>8.2f}")
        if model:
            m = r.get("model_busbw_gbps")
            line += f" {m:>8.2f}" if m is not None else f" {'-':>8}"
        lines.append(line)
    busbws = [r["busbw_gbps"] for r in rows]
    if busbws and world_size > 1:
        lines.append(f"# Avg bus bandwidth    : {sum(busbws) / len(busbws):.3f}")
    return "\n".join(lines)
