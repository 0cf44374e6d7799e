"""Run a function on N real processes joined by a gloo process group, and bring failures back to the test.

Each worker gets its own process (torch.multiprocessing, spawn), a FileStore in a fresh temporary directory (no
port to collide with), and runs ``fn(rank, world_size, *args)``. A worker's exception is re-raised in the test with
its traceback; a worker that hangs is killed at ``timeout`` and the test fails instead of hanging CI.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerError(AssertionError):
    """A worker raised; the message carries its rank and traceback."""


def _worker(rank: int, world_size: int, store_path: str, results: Any, fn: Callable, args: tuple) -> None:
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, None))
    except BaseException:  # everything, assertion errors included, goes back to the test
        results.put((rank, traceback.format_exc()))


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; raise WorkerError if any fails."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, results, fn, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        failures, finished = [], 0
        try:
            while finished < world_size:
                try:
                    rank, error = results.get(timeout=timeout)
                except queue.Empty:
                    raise WorkerError(f"workers did not finish within {timeout} s (hang?)") from None
                finished += 1
                if error is not None:
                    failures.append(f"rank {rank} failed:\n{error}")
                    break  # the others may now wait forever on the failed rank: stop them
        finally:
            for p in procs:
                p.join(timeout=5 if not failures else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        if failures:
            raise WorkerError("\n".join(failures))
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, None)]
        if bad:
            raise WorkerError(f"workers exited abnormally: {bad}")
