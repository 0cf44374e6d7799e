"""Timing all-reduces (nccl-tests style) and DDP training steps, and running that on local processes.

What is timed, and how:

* ``run_sweep``: for each dtype, size and algorithm, ``warmup`` all-reduces, then ``iters`` all-reduces each timed
  alone (CUDA events around each on the GPU, no host sync between them; wall clock around each on CPU). Every rank
  takes its median; the row reports the slowest rank's median (an all-reduce is as slow as its slowest rank, as
  nccl-tests reports the maximum over ranks). In-place, like DDP. One more all-reduce of ones then checks the sum.
  Every rank follows rank 0's plan (``agree_on_plan``): sizes, dtypes, algorithms, warmup and iterations.
* ``run_e2e``: real DDP training steps of the user's model for candidate bucket sizes and comm hooks; the median
  step time of the slowest rank decides.

``spawn_local`` runs a function on one process per local GPU (or N CPU processes with gloo) with a FileStore in a
temporary directory, and hands back rank 0's JSON-able result; under ``torchrun`` the CLI calls the functions in
place instead.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .algo_groups import make_algorithm_groups
from .cost_model import busbw_factor, dtype_size, normalize_dtype
from .log import warn_once

# --------------------------------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------------------------------


def comm_device(group: Any = None) -> torch.device:
    """Device a collective on ``group`` needs its tensors on: the current CUDA device for NCCL, else CPU."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _worker(rank: int, world_size: int, backend: str, store_path: str, result_path: str, fn_path: str,
            args: Tuple[Any, ...]) -> None:
    """Entry point of a spawned process: join the group, run the function, rank 0 writes its JSON result."""
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        module, _, name = fn_path.partition(":")
        fn = getattr(importlib.import_module(module), name)
        result = fn(*args)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other ranks may never reach one
        raise
    leave_process_group()


def spawn_local(fn_path: str, nprocs: int, backend: str, args: Sequence[Any] = (),
                timeout_s: float = 3600.0) -> Any:
    """Run ``MODULE:FUNCTION`` on ``nprocs`` fresh processes joined in one group; rank 0's JSON result.

    Raises the first worker's exception (with its traceback in the message); kills every worker and raises
    TimeoutError after ``timeout_s``.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ddp-triton-") as tmp:
        store_path = os.path.join(tmp, "store")
        result_path = os.path.join(tmp, "result.json")
        ctx = mp.start_processes(_worker, args=(nprocs, backend, store_path, result_path, fn_path, tuple(args)),
                                 nprocs=nprocs, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn_path} on {nprocs} processes did not finish in {timeout_s:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        with open(result_path) as f:
            return json.load(f)


def init_in_place(backend: str) -> bool:
    """Join a process group from a launcher's environment (torchrun), or as a group of one; True if we created it.

    Under torchrun (``RANK``/``WORLD_SIZE`` set) this uses env:// and binds ``LOCAL_RANK``'s GPU for NCCL.
    """
    if dist.is_initialized():
        return False
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, init_method="env://")
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


#: Seconds a gloo group is left alone, the GIL released, before it is destroyed (see ``leave_process_group``).
GLOO_SETTLE_S = 0.1


def leave_process_group() -> None:
    """Destroy the default group once every rank has finished with it (call it on success only).

    On gloo this is not just ``destroy_process_group``. In torch 2.4, destroying a gloo group while one of its
    worker threads is still dropping a finished collective deadlocks: the destructor holds the GIL and joins the
    thread, and the thread needs the GIL to free the collective's tensors (those of ``broadcast_object_list``, say,
    which Python has already let go of). A barrier alone does not help, since the barrier's own work holds the
    earlier ones. So every rank waits at a barrier, then sleeps briefly with the GIL released, which lets the
    worker threads finish; then the group goes.
    """
    backend = str(dist.get_backend()).lower()
    if dist.get_world_size() > 1:
        dist.barrier()
    if "gloo" in backend:
        time.sleep(GLOO_SETTLE_S)
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr (rank 0 only); on a non-terminal, a line every tenth of the way."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30):
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.width = width
        self.tty = sys.stderr.isatty()
        self._last_tenth = -1
        self._t0 = time.monotonic()

    def step(self, label: str = "") -> None:
        if not self.enabled:
            return
        self.done += 1
        frac = self.done / self.total
        fill = int(frac * self.width)
        bar = f"[{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} {label}"
        if self.tty:
            sys.stderr.write("\r" + bar.ljust(self.width + 40))
            if self.done == self.total:
                sys.stderr.write(f"  {time.monotonic() - self._t0:.1f} s\n")
        elif int(frac * 10) != self._last_tenth:
            self._last_tenth = int(frac * 10)
            sys.stderr.write(bar + "\n")
        sys.stderr.flush()


# --------------------------------------------------------------------------------------------------------------------
# All-reduce sweep
# --------------------------------------------------------------------------------------------------------------------


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


def agree_on_plan(plan: Dict[str, Any]) -> Dict[str, Any]:
    """Rank 0's ``plan`` (a picklable dict) on every rank; every rank of the default group calls this.

    Ranks that read their machine or NCCL version differently would otherwise create different groups and issue
    different all-reduces, and hang. A rank whose own plan differs warns and follows rank 0. A plan
    ``{"error": message}`` from rank 0 (it could not make one) is raised as ValueError on every rank alike.
    """
    box = [plan]
    dist.broadcast_object_list(box, src=0)
    agreed = box[0]
    if "error" in agreed:
        raise ValueError(agreed["error"])
    if agreed != plan:
        differ = sorted(k for k in set(agreed) | set(plan) if agreed.get(k) != plan.get(k))
        warn_once(f"rank {dist.get_rank()}: its measurement plan differs from rank 0's in {', '.join(differ)}; "
                  "following rank 0's", all_ranks=True)
    return agreed


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
    device = comm_device()
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


# --------------------------------------------------------------------------------------------------------------------
# End to end: DDP steps of the user's model
# --------------------------------------------------------------------------------------------------------------------

#: Hooks e2e mode can try. "allreduce": DDP's own fp32 all-reduce (no hook); "bf16_compress": torch's
#: bf16_compress_hook; "triton": ddp_triton's hook with a CommState built from the base profile.
E2E_HOOKS = ("allreduce", "bf16_compress", "triton")


def load_factory(spec: str) -> Callable[[], Tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]]:
    """Import ``MODULE:FUNCTION`` for e2e mode; ValueError with the reason if it cannot be had.

    The contract: ``FUNCTION()`` takes no arguments and returns ``(model, loss_fn)``: an ``nn.Module`` (any device;
    it is moved to this rank's device) and ``loss_fn(model) -> scalar tensor`` that makes one batch on the model's
    device (``next(model.parameters()).device``), runs the forward pass and returns the loss. Every rank calls it;
    DDP broadcasts rank 0's weights, so the model needs no seeding, but its parameters must be the same shapes.
    """
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--e2e wants MODULE:FUNCTION, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a model file next to where the user runs the command
    try:
        mod = importlib.import_module(module)
    except Exception as e:
        raise ValueError(f"cannot import {module!r} for --e2e: {e.__class__.__name__}: {e}") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"{module!r} has no function {name!r} for --e2e")
    return fn


def _register_hook(ddp: Any, hook: str, profile_dict: Optional[Dict[str, Any]]) -> None:
    if hook == "allreduce":
        return
    if hook == "bf16_compress":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return
    if hook == "triton":
        from .hook import triton_hook  # type: ignore[attr-defined]
        from .profile import Profile
        from .state import CommState  # type: ignore[attr-defined]

        prof = Profile.from_dict(profile_dict) if profile_dict else None
        ddp.register_comm_hook(CommState(process_group=None, comm_dtype=torch.bfloat16, profile=prof), triton_hook)
        return
    raise ValueError(f"unknown hook {hook!r}; known: {', '.join(E2E_HOOKS)}")


def _time_steps(ddp: Any, loss_fn: Callable[[Any], torch.Tensor], opt: torch.optim.Optimizer, warmup: int,
                steps: int, device: torch.device) -> List[float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        loss = loss_fn(ddp)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def run_e2e(factory_spec: str, bucket_mbs: Optional[Sequence[float]], hooks: Sequence[str], warmup: int,
            steps: int, profile_dict: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Time DDP steps for every (hook, bucket_cap_mb); every rank returns the same result dict.

    ``bucket_mbs`` None: ``e2e_bucket_candidates`` around the profile's bucket_cap_mb (25 without a profile).

    Result: ``{"model_bytes", "candidates": [{"hook", "bucket_cap_mb", "step_ms"} or {..., "error"}], "winner"}``
    with the slowest rank's median step time per candidate. A hook that cannot be had (import error) is skipped
    with its reason (the hook's own checks, e.g. torch's bf16 hook wants CUDA and NCCL); an error inside a step is
    raised (it would leave the ranks out of step).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = comm_device()
    factory = load_factory(factory_spec)
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)
            and callable(made[1])):
        raise ValueError(f"{factory_spec} must return (model: nn.Module, loss_fn), got {type(made).__name__}")
    base_model, loss_fn = made
    base_model = base_model.to(device)
    model_bytes = sum(p.numel() * p.element_size() for p in base_model.parameters() if p.requires_grad)
    if bucket_mbs is None:
        base_mb = float(profile_dict["bucket_cap_mb"]) if profile_dict else 25.0
        bucket_mbs = e2e_bucket_candidates(base_mb, model_bytes)
    candidates: List[Dict[str, Any]] = []
    medians: List[float] = []
    for hook in hooks:
        for mb in bucket_mbs:
            model = copy.deepcopy(base_model)
            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=mb,
                      gradient_as_bucket_view=True)
            try:
                # Local checks only (imports, torch's hook preconditions): every rank fails alike, none waits.
                _register_hook(ddp, hook, profile_dict)
            except Exception as e:
                candidates.append({"hook": hook, "bucket_cap_mb": None, "error": f"{e.__class__.__name__}: {e}"})
                break
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
            times = _time_steps(ddp, loss_fn, opt, warmup, steps, device)
            candidates.append({"hook": hook, "bucket_cap_mb": mb})
            medians.append(statistics.median(times))
            del ddp, model, opt
    timed = [c for c in candidates if "error" not in c]
    if not timed:
        raise RuntimeError(f"no e2e candidate could run: {candidates}")
    stats = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    for c, ms in zip(timed, stats.tolist()):
        c["step_ms"] = ms
    winner = min(timed, key=lambda c: c["step_ms"])
    return {"factory": factory_spec, "warmup": warmup, "steps": steps, "model_bytes": model_bytes,
            "world_size": dist.get_world_size(), "candidates": candidates, "winner": dict(winner),
            "gradient_as_bucket_view": True}


def e2e_bucket_candidates(base_mb: float, model_bytes: int) -> List[float]:
    """Bucket sizes to try: the profile's choice, half and twice it, and DDP's default 25 MiB, none above the
    model's size (one bucket holds everything there)."""
    model_mb = max(model_bytes / (1 << 20), 1e-3)
    picks = {round(x, 4) for x in (base_mb / 2, base_mb, base_mb * 2, 25.0)}
    out = sorted({min(x, round(model_mb, 4)) for x in picks if x > 0 and math.isfinite(x)})
    return out
