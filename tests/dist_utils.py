"""Run a function on N real processes joined by a gloo process group, and bring failures back to the test.

Each worker gets its own process, a FileStore in a fresh temporary directory (no port to collide with), and runs
``fn(rank, world_size, *args)``. Workers are forked from a server process that has imported torch, Triton, DDP,
FSDP and this project once (``start``): a spawned worker would spend seconds importing them, most of a short test.
Triton and the project's kernels read the interpreter switch (TRITON_INTERPRET) when kernels are decorated, so a
worker is forked from the server that imported them with the test's value of it. Workers start with the test's
environment and working directory as they were at the call, and unpickle ``fn`` and its arguments only then.

With ``init=False`` the worker starts without a process group, so ``fn`` can build things before one exists; it
joins the group with ``init_gloo(rank, world_size)``. A worker's exception is re-raised in the test with its
traceback; a worker that hangs is killed at ``timeout`` and the test fails instead of hanging CI; a worker that
dies without reporting (a crash) fails the test too.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from multiprocessing import forkserver
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_triton.runtime.algo_groups import scoped_env


class WorkerError(AssertionError):
    """A worker raised; the message carries its rank and traceback."""


_STORE_ENV = "DDPT_TEST_STORE"

# Imported by each fork server before any worker exists: torch's heavy modules, Triton and the project. Triton and
# the project's kernels read TRITON_INTERPRET when kernels are decorated, so there is a server per value of it the
# tests use (most workers run with "0", the CPU path of production); nothing else here reads a setting a test
# changes.
_PRELOAD = ["torch", "torch.distributed", "torch.nn", "torch.nn.parallel", "torch.multiprocessing",
            "torch.distributed.fsdp", "torch._dynamo", "numpy", "pytest", "triton",
            "ddp_triton.runtime.hook", "ddp_triton.runtime.fsdp", "ddp_triton.runtime.clip"]
_SETTING = "TRITON_INTERPRET"
_SERVERS: Dict[Optional[str], forkserver.ForkServer] = {}

#: In a worker: the modules it had when it started, before the test's function was unpickled (its server's preload).
PRELOADED: frozenset = frozenset()


def worker_context():
    """The multiprocessing context of the workers; start them with :func:`start`."""
    return mp.get_context("forkserver")


def _server(setting: Optional[str]) -> forkserver.ForkServer:
    """The fork server that imported the project with TRITON_INTERPRET at ``setting`` (None: unset), started on
    first use and kept for the test session."""
    if setting not in _SERVERS:
        server = forkserver.ForkServer()
        server.set_forkserver_preload(_PRELOAD)
        with scoped_env({_SETTING: setting}):
            server.ensure_running()
        _SERVERS[setting] = server
    return _SERVERS[setting]


def start(procs: List[Any]) -> None:
    """Start ``procs`` (of :func:`worker_context`) forked from the server that imported the project with the test's
    TRITON_INTERPRET, as freshly spawned processes would import it.

    multiprocessing forks each new process through its module-level server, looking the function up at each start
    (the same from Python 3.9 to 3.14, though internal); it is pointed at ours while these start."""
    server = _server(os.environ.get(_SETTING))
    default = forkserver.connect_to_new_process
    forkserver.connect_to_new_process = server.connect_to_new_process
    try:
        for p in procs:
            p.start()
    finally:
        forkserver.connect_to_new_process = default


def start_as_the_test_left_off(env: dict, cwd: str, payload: bytes) -> Any:
    """In a worker: take the test's environment and working directory and one intra-op thread (N workers share a
    few cores: more threads would spin on each other), then unpickle what ``payload`` holds."""
    global PRELOADED
    PRELOADED = frozenset(sys.modules)
    torch.set_num_threads(1)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    return pickle.loads(payload)


def call_as_the_test_left_off(test_state: tuple, *live: Any) -> None:
    """A worker's target: ``fn(*args, *live)`` for the ``(fn, args)`` of ``test_state`` (from :func:`snapshot`).
    ``live`` holds what only a process start can hand over (multiprocessing queues)."""
    fn, args = start_as_the_test_left_off(*test_state)
    fn(*args, *live)


def snapshot(*objects: Any) -> tuple:
    """What :func:`start_as_the_test_left_off` needs to rebuild ``objects`` in a worker as the test sees them now."""
    return dict(os.environ), os.getcwd(), pickle.dumps(objects)


def init_gloo(rank: int, world_size: int) -> None:
    """Join the workers' gloo group through their FileStore (for ``run_workers(..., init=False)``)."""
    store = dist.FileStore(os.environ[_STORE_ENV], world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def _worker(rank: int, world_size: int, store_path: str, results: Any, test_state: tuple) -> None:
    try:
        fn, args, init = start_as_the_test_left_off(*test_state)
        os.environ[_STORE_ENV] = store_path
        if init:
            init_gloo(rank, world_size)
        fn(rank, world_size, *args)
        if not dist.is_initialized():
            raise AssertionError("a worker started with init=False must join the group (init_gloo)")
        dist.barrier()  # nobody leaves while another rank may still be talking to it
        results.put((rank, None))
    except BaseException:  # everything, assertion errors included, goes back to the test
        results.put((rank, traceback.format_exc()))
    # Flush the report, then leave without tearing the process groups down: gloo's teardown with several groups
    # sometimes aborts in a background thread ("Resource deadlock avoided") after the work is done and reported,
    # which says nothing about the code under test. The process ends here either way.
    results.close()
    results.join_thread()
    os._exit(0)


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, init: bool = True) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; raise WorkerError if any fails.

    ``init=False``: ``fn`` starts before the process group exists and joins it itself (``init_gloo``)."""
    ctx = worker_context()
    results = ctx.Queue()
    test_state = snapshot(fn, args, init)
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, results, test_state), daemon=True)
                 for r in range(world_size)]
        start(procs)
        failures, reported = [], set()
        deadline = time.monotonic() + timeout
        try:
            while len(reported) < world_size and not failures:
                try:
                    rank, error = results.get(timeout=0.5)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)]
                    if dead:  # died without a report: a crash, not an exception
                        failures.append(f"ranks {dead} died without reporting (exit codes "
                                        f"{[procs[r].exitcode for r in dead]})")
                    elif time.monotonic() > deadline:
                        raise WorkerError(f"workers did not finish within {timeout} s (hang?)") from None
                    continue
                reported.add(rank)
                if error is not None:
                    failures.append(f"rank {rank} failed:\n{error}")  # the others may now wait on it forever
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
