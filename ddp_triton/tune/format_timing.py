"""Timing a bucket's whole exchange in each wire format, through the hook's own path, per bucket size.

``time_formats``: for each bucket size (gradient bytes, float32), a state of each format binds a bucket of that many
gradients exactly as the hook binds DDP's (``CommState.plan_for``) and runs it ``warmup`` times; then rounds, each
timing one exchange per format in turn (the order rotates from round to round, so drift and bursts of load fall on
every format alike), from the pack to the averaged bucket (the collectives, the passes and the host work between
them: what a bucket costs a step). After each round the ranks take the slowest rank's time of each exchange, and
the time spent so far, by one small all-reduce: every rank holds the same samples and so stops together. A size
stops once every format's median is known within ``rel_error`` (``format_rule.median_interval``), and after
``min_rounds``, when its share of ``budget_s`` is spent (what earlier sizes left over, shared among those to
come), or at ``max_rounds``. Every rank follows rank 0's plan (``processes.agree_on_plan``).
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..formats import WireFormat, canonical_name
from ..machine import cost_model as cm
from ..machine.profile import DEFAULT_BUDGET_S, DEFAULT_REL_ERROR, MAX_ROUNDS, MIN_ROUNDS, median_interval, runs_flat
from ..runtime.algo_groups import collective_device, gather_text
from ..runtime.nodes import node_name, partition
from ..runtime.state import CommState
from .processes import agree_on_plan
from .progress import Progress

class _Bucket:
    """What binding a bucket (``CommState.plan_for``) reads of DDP's GradBucket: one tensor's gradients as the whole
    bucket."""

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


def node_count() -> int:
    """How many nodes the default group's ranks are on, as the runtime's node groups count them (torchrun's
    ``GROUP_RANK``, else the host name): every rank calls this (one all-gather)."""
    digest = hashlib.sha256(node_name().encode()).hexdigest()
    return len(partition(gather_text(digest, dist.group.WORLD)))


def _time_once(comm: Any, on_cuda: bool) -> float:
    """Microseconds of one exchange of a bound bucket, from the start to the averaged bucket."""
    if on_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    comm.run(True).wait()
    if on_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6


def _check_plan(plan: Dict[str, Any]) -> None:
    if plan["warmup"] < 0 or not 1 <= plan["min_rounds"] <= plan["max_rounds"]:
        raise ValueError(f"need warmup >= 0 and 1 <= min_rounds <= max_rounds, got {plan['warmup']}, "
                         f"{plan['min_rounds']}, {plan['max_rounds']}")
    if not (0.0 < plan["rel_error"] and math.isfinite(plan["rel_error"])):
        raise ValueError(f"rel_error must be a finite fraction > 0, got {plan['rel_error']!r}")
    if not (plan["budget_s"] >= 0.0 and math.isfinite(plan["budget_s"])):
        raise ValueError(f"budget_s must be finite and >= 0, got {plan['budget_s']!r}")


def time_formats(sizes: Sequence[int], formats: Sequence[str], warmup: int = 2, min_rounds: int = MIN_ROUNDS,
                 max_rounds: int = MAX_ROUNDS, rel_error: float = DEFAULT_REL_ERROR,
                 budget_s: float = DEFAULT_BUDGET_S, progress: bool = True, fabric: Optional[cm.Fabric] = None,
                 host: cm.HostCost = cm.GPU_HOST_COST) -> List[Dict[str, Any]]:
    """Time every (bucket size, format) on the default group; every rank returns the same rows.

    Rows: ``bytes`` (gradient bytes), ``format``, ``time_us`` (the median of the rounds' slowest-rank times),
    ``interval_us`` (the confidence interval on it), ``samples`` (rounds) and ``model_us``, the cost model's time
    on ``fabric`` with ``host`` (None without a fabric). A two-level format where the exchange runs flat here (one
    node, or one rank per node) is a ValueError: time its flat format (``admitted_formats`` names it so). The bucket
    holds random gradients (the same on every rank, so the average stays finite however often it is taken)."""
    names = [canonical_name(f) for f in formats]
    plan = agree_on_plan({"sizes": [int(s) for s in sizes], "formats": names, "warmup": int(warmup),
                          "min_rounds": int(min_rounds), "max_rounds": int(max_rounds),
                          "rel_error": float(rel_error), "budget_s": float(budget_s)})
    _check_plan(plan)
    sizes, names = plan["sizes"], plan["formats"]
    nodes = node_count()
    flat = [n for n in names if WireFormat.parse(n).two_level and runs_flat(dist.get_world_size(), nodes)]
    if flat:
        raise ValueError(f"{', '.join(flat)}: on {nodes} node(s) of {dist.get_world_size()} ranks a two-level "
                         "exchange runs flat; time the flat format instead")
    device = collective_device(dist.group.WORLD)
    bar = Progress(len(sizes), enabled=progress and dist.get_rank() == 0)
    # In one order on every rank: some create groups.
    states = {name: CommState(**WireFormat.parse(name).options(), profile=None) for name in names}
    buckets: List[_Bucket] = []  # alive to the end: residuals are kept by parameter identity
    rows: List[Dict[str, Any]] = []
    t0 = time.perf_counter()
    spent = 0.0  # seconds so far, the slowest rank's: the same on every rank
    for i, size in enumerate(sizes):
        deadline = spent + max(0.0, plan["budget_s"] - spent) / (len(sizes) - i)
        n = max(1, size // 4)
        gen = torch.Generator().manual_seed(n)
        values = torch.randn(n, generator=gen).to(device)
        comms = {}
        for name in names:
            bucket = _Bucket(values.clone())
            buckets.append(bucket)
            comms[name] = states[name].plan_for(bucket.buffer(), bucket)
            for _ in range(plan["warmup"]):
                comms[name].run(True).wait()
        samples, spent = _rounds(comms, names, plan, device, t0, deadline)
        for name in names:
            stats = median_interval(samples[name])
            model = None if fabric is None else cm.bucket_time_us(fabric, n, name, host)
            rows.append({"bytes": size, "format": name, "time_us": stats.median_us,
                         "interval_us": [stats.lo_us, stats.hi_us], "samples": stats.samples, "model_us": model})
            states[name].plans.clear()  # this bucket's buffers and residuals go; the next size binds its own
            states[name].residuals.layouts.clear()
        for bucket in buckets[-len(names):]:
            bucket._buffer = values  # the clone's memory back
        bar.step(f"{size} B, {len(samples[names[0]])} rounds")
    return rows


def _rounds(comms: Dict[str, Any], names: List[str], plan: Dict[str, Any], device: torch.device, t0: float,
            deadline: float) -> Tuple[Dict[str, List[float]], float]:
    """Timed rounds of one size until its medians are known within the plan's error, its time is up (``deadline``,
    seconds since ``t0``) or the rounds run out: the slowest rank's microseconds per exchange by format, and the
    seconds spent since ``t0`` (the slowest rank's)."""
    on_cuda = device.type == "cuda"
    samples: Dict[str, List[float]] = {name: [] for name in names}
    spent = 0.0
    for r in range(plan["max_rounds"]):
        k = r % len(names)
        mine = {name: _time_once(comms[name], on_cuda) for name in names[k:] + names[:k]}
        slowest = torch.tensor([mine[name] for name in names] + [time.perf_counter() - t0], dtype=torch.float64,
                               device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        agreed = slowest.tolist()
        for name, t in zip(names, agreed):
            samples[name].append(t)
        spent = agreed[-1]
        if r + 1 < plan["min_rounds"]:
            continue
        if spent >= deadline or all(median_interval(samples[name]).relative_error <= plan["rel_error"]
                                    for name in names):
            break
    return samples, spent
