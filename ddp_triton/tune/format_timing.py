"""Timing a bucket's whole exchange in each wire format, through the hook's own path, per bucket size.

``time_formats``: for each bucket size (gradient bytes, float32) and format, a state of that format binds a bucket
of that many gradients exactly as the hook binds DDP's (``CommState.bucket_comm``) and runs it ``warmup`` times,
then ``iters`` times each timed alone from the pack to the averaged bucket (the collectives, the passes and the host
work between them: what a bucket costs a step). Every rank takes its median; a row reports the slowest rank's.
Every rank follows rank 0's plan (``processes.agree_on_plan``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..machine import cost_model as cm
from ..runtime.state import CommState
from ..runtime.wire import wire_format_named
from .processes import agree_on_plan, comm_device
from .progress import Progress


class _Bucket:
    """What the hook reads of DDP's GradBucket: one tensor's gradients as the whole bucket."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer
        # FP8's blocks follow its size; nothing reads its values, so it needs no memory of its own.
        self._params = [torch.empty(1, device=buffer.device).expand(buffer.numel())]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def parameters(self) -> List[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return True


def _state_for(name: str) -> CommState:
    wire = wire_format_named(name)
    return CommState(comm_dtype=wire.comm_dtype, accumulate_dtype=wire.accumulate_dtype,
                     error_feedback=wire.error_feedback if wire.block_scaled else None,
                     hierarchical=wire.hierarchical, profile=None)


def _time_bucket(state: CommState, bucket: _Bucket, warmup: int, iters: int) -> List[float]:
    """Microseconds per exchange of ``bucket``, each from the start to the averaged bucket."""
    comm = state.bucket_comm(bucket)
    on_cuda = bucket.buffer().is_cuda
    for _ in range(warmup):
        comm.start(True).wait()
    out = []
    for _ in range(iters):
        if on_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        comm.start(True).wait()
        if on_cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def time_formats(sizes: Sequence[int], formats: Sequence[str], warmup: int = 2, iters: int = 5,
                 progress: bool = True, fabric: Optional[cm.Fabric] = None,
                 host: cm.HostCost = cm.GPU_HOST_COST) -> List[Dict[str, Any]]:
    """Time every (bucket size, format) on the default group; every rank returns the same rows.

    Rows: ``bytes`` (gradient bytes), ``format``, ``time_us`` (the slowest rank's median) and ``model_us``, the cost
    model's time on ``fabric`` with ``host`` (None without a fabric). The bucket holds random gradients (the same on
    every rank, so the average stays finite however often it is taken)."""
    names = [cm.parse_format(f).name for f in formats]
    plan = agree_on_plan({"sizes": [int(s) for s in sizes], "formats": names, "warmup": int(warmup),
                          "iters": int(iters)})
    sizes, names, warmup, iters = plan["sizes"], plan["formats"], plan["warmup"], plan["iters"]
    if warmup < 0 or iters < 1:
        raise ValueError(f"need warmup >= 0 and iters >= 1, got {warmup}, {iters}")
    device = comm_device()
    bar = Progress(len(sizes) * len(names), enabled=progress and dist.get_rank() == 0)
    states = {name: _state_for(name) for name in names}  # in one order on every rank: some create groups
    medians: List[float] = []
    buckets: List[_Bucket] = []  # alive to the end: residuals are kept by parameter identity
    for size in sizes:
        n = max(1, size // 4)
        gen = torch.Generator().manual_seed(n)
        values = torch.randn(n, generator=gen).to(device)
        for name in names:
            bucket = _Bucket(values.clone())
            buckets.append(bucket)
            medians.append(statistics.median(_time_bucket(states[name], bucket, warmup, iters)))
            states[name].buckets.clear()  # this bucket's buffers and residuals go; the next size binds its own
            states[name].residuals.layouts.clear()
            bucket._buffer = values  # the clone's memory back
            bar.step(f"{name} {size} B")
    slowest = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rows = []
    for i, (size, name) in enumerate((s, f) for s in sizes for f in names):
        model = None if fabric is None else cm.bucket_time_us(fabric, max(1, size // 4), name, host)
        rows.append({"bytes": size, "format": name, "time_us": float(slowest[i]), "model_us": model})
    return rows
