"""Running a function on a group of processes, and leaving the group cleanly: what the CLI and the benchmarks share.

``spawn_local`` runs ``MODULE:FUNCTION`` on one process per local GPU (or N CPU processes with gloo) joined by a
FileStore in a temporary directory, and hands back rank 0's JSON-able result; under ``torchrun`` the caller runs
the function in place after ``init_in_place``. ``leave_process_group`` destroys the group without torch 2.4's
gloo deadlock. ``agree_on_plan`` makes every rank follow rank 0's plan of what to measure.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
import time
from typing import Any, Dict, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..log import warn_once
from ..machine.topology import under_torchrun


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
    if under_torchrun():
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
