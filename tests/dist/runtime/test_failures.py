"""A failed collective stops training on every surviving rank, with a message naming it and saying a peer is gone.

Tier: gloo multi-process on CPU, processes started here without an agent (as two nodes' torchrun agents would be:
nobody kills the survivors for us), plus unit tests of the hook's completion on a failed future and of the exchange
queue's message (stand-in collectives, no process group).

One set of processes covers many formats: every rank trains one model per format (each on its own process group),
step by step in one order, and one rank is killed at a given step; each survivor then runs that step of every
format in turn, each of which must fail at once with the clear message. Two ranks hold every flat format and FSDP's
reduce-scatter (the survivor's only peer is the dead one, so no format's failure waits on another's); three ranks
the float32 sum's all-to-all and all-gather; four ranks (two nodes of two, as ``GROUP_RANK`` says) the two-level
formats, where a survivor's collective that waits on another survivor is released once that one has failed its
steps and exited, as it would in a job.
"""

import os
import queue
import re
import signal
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_triton.runtime.algo_groups import scoped_env
from ddp_triton.runtime.collective_errors import collective_error
from ddp_triton.runtime.exchange import ExchangeQueue, Stage, StagedExchange
from ddp_triton.runtime.plan import Plan
from ddp_triton.runtime.telemetry import BucketRecord
from ddp_helpers import LOST_PEER, peer_death_problem
from dist_utils import call_as_the_test_left_off, snapshot, start, worker_context

KILL_AT_STEP = 10
# A survivor's step must raise within this long of the peer's death (or of the step's start, for the formats it runs
# after the first): gloo sees the reset connection at once (well under a second here), the bound leaves room for a
# loaded 2-core CI machine; a hang would run into the groups' timeout below.
FAIL_SECONDS = 15
GROUP_TIMEOUT = timedelta(seconds=60)
# The whole run, process starts (imports of torch, Triton, DDP's dynamo) included, on a loaded 2-core machine.
RUN_SECONDS = 300


class _Work:
    """A stand-in collective's Work, its future completed by the test."""

    def __init__(self, future):
        self.future = future

    def get_future(self):
        return self.future


def _all_reduce_plan(buffer, reduced, unpacked):
    """A bucket's plan of one all-reduce, whose collective's future is ``reduced`` and whose unpack notes itself."""
    stage = Stage("pack", lambda: None, "all_reduce", lambda: _Work(reduced), "group")
    exchange = StagedExchange(buffer, [stage], lambda: unpacked.append(True), ())
    return Plan(buffer, exchange, None, buffer, None, None, None, None, BucketRecord())


def test_a_failed_all_reduce_fails_the_hook_future_and_skips_the_unpack():
    unpacked = []
    reduced = torch.futures.Future()
    done = _all_reduce_plan(torch.zeros(3), reduced, unpacked).run(False)
    reduced.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match=f"all_reduce of a bucket {LOST_PEER}.*Connection closed by peer"):
        done.wait()
    assert unpacked == []


def test_a_completed_all_reduce_unpacks_and_gives_the_buffer():
    buffer = torch.arange(3.0)
    unpacked = []
    reduced = torch.futures.Future()
    done = _all_reduce_plan(buffer, reduced, unpacked).run(False)
    reduced.set_result([buffer])
    assert done.wait() is buffer and unpacked == [True]


class _FailingWork:
    """A stand-in collective's Work whose future fails as gloo's does when a peer is gone."""

    def __init__(self, message):
        self.future = torch.futures.Future()
        self.future.set_exception(RuntimeError(message))

    def get_future(self):
        return self.future


def test_the_exchange_queue_names_the_failed_collective_and_its_bucket():
    """The first collective's failure fails the bucket's future with the collective, the bucket and its format
    named; the bucket queued behind it fails leading with that same message."""
    issued = []

    def exchange(index):
        def issue():
            issued.append(index)
            return _FailingWork("[pair.cc:537] Read error [127.0.0.1]:4242: Connection reset by peer")

        stages = [Stage("pack", lambda: None, "all_to_all", issue, "group"),
                  Stage("reduce", lambda: None, "all_gather", issue, "group")]
        return StagedExchange(torch.zeros(2), stages, lambda: None, (), subject=f"bucket {index} (fp8e4m3+ef wire)")

    queue = ExchangeQueue()
    first, second = queue.start(exchange(3), last=False), queue.start(exchange(4), last=True)
    for done in (first, second):
        with pytest.raises(RuntimeError, match=re.escape("ddp_triton: all_to_all of bucket 3 (fp8e4m3+ef wire) ")
                           + LOST_PEER + ".*Connection reset by peer"):
            done.wait()
    assert issued == [3]  # bucket 4's collectives were never paired with the wrong ones


@pytest.mark.parametrize("said, told", [
    ("[pair.cc:598] Connection closed by peer [127.0.0.1]:1234", LOST_PEER),
    ("[pair.cc:525] Timed out waiting 60000ms for recv operation to complete", "timed out: a peer is gone or stuck"),
    ("NCCL error: remote process exited or there was a network error", LOST_PEER),
    ("unsupported tensor layout", "failed: a peer may be gone, or the backend failed on this rank"),
], ids=["gloo-closed", "gloo-timeout", "nccl-remote", "other"])
def test_a_collective_error_says_what_the_backend_said_and_what_it_means(said, told):
    error = collective_error("cross_all_gather", "bucket 0 (two-level bf16 wire)", RuntimeError(said))
    assert str(error).startswith(f"ddp_triton: all_gather between nodes of bucket 0 (two-level bf16 wire) {told}")
    assert str(error).endswith(f"The backend said: {said}")


# Each case: the options of one model's state (a DDP CommState, or ddp_triton.fsdp.register's for FSDP) by the
# wire format's name as the failure names it.
FLAT = {
    "fp32": dict(comm_dtype=torch.float32),
    "bf16": dict(comm_dtype=torch.bfloat16),
    "fp16": dict(comm_dtype=torch.float16),
    "bf16+fp32sum": dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32),
    "fp8e4m3+ef": dict(comm_dtype=torch.float8_e4m3fn),  # all-to-all, float32 sum, all-gather
    "fp8e5m2": dict(comm_dtype=torch.float8_e5m2, error_feedback=False),
}
# Online tuning, killed mid-tuning (its trials run passes 1-37): the bucket's collective in the trial's format
# fails, or the tuner's one all-reduce of the ranks' timings.
ONLINE = {"online": dict(comm_dtype="auto", tune="online", profile=None,
                         formats=["fp32", "bf16", "bf16+fp32sum", "fp8e4m3+ef"])}
FSDP = {  # FSDP2's reduce-scatter replaced by ours: an all-to-all and a float32 sum
    "bf16+fp32sum": dict(comm_dtype=torch.bfloat16),
    "fp8e4m3+ef": dict(comm_dtype=torch.float8_e4m3fn),
}
TWO_LEVEL = {  # reduce-scatter in the node, the format between nodes, all-gather in the node: three groups
    "two-level fp8e4m3+ef": dict(comm_dtype=torch.float8_e4m3fn, hierarchical=True),
    "two-level bf16": dict(comm_dtype=torch.bfloat16, hierarchical=True),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _fsdp_model(mesh):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for module in (model[0], model[2], model):  # no all-gather in the backward: its first collective is ours
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
    return model


def _train_until_peer_dies(rank, world_size, store_path, kill_path, ddp_cases, fsdp_cases, results):
    """Train one model per case, a step of each in turn, until rank 1 kills itself at KILL_AT_STEP (after FSDP's
    forwards, whose all-gathers need it); then report, per case, when and how that step failed here."""
    os.environ["GROUP_RANK"] = str(rank // 2)  # two ranks per node (what torchrun tells each worker)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
    ddps = {}
    for name, options in ddp_cases.items():  # each on a group of its own: its failure is its own
        group = dist.new_group(list(range(world_size)), timeout=GROUP_TIMEOUT)
        ddps[name] = DDP(_model(), process_group=group, bucket_cap_mb=0.001)
        ddp_triton.register(ddps[name], **options)
    fsdps = {}
    if fsdp_cases:
        from torch.distributed.device_mesh import init_device_mesh

        from ddp_triton.fsdp import register as register_fsdp

        mesh = init_device_mesh("cpu", (world_size,))
        for name, options in fsdp_cases.items():
            fsdps[name] = _fsdp_model(mesh)
            register_fsdp(fsdps[name], **options)
    models = [("DDP", name, m) for name, m in ddps.items()] + [("FSDP", name, m) for name, m in fsdps.items()]
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=0.01) for _, _, m in models}
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    failed = {}
    for step in range(KILL_AT_STEP + 2):
        # FSDP's forwards first, on every rank: they all-gather, and so need the peer that dies after them.
        outputs = {id(m): m(x) for kind, name, m in models if kind == "FSDP" and (kind, name) not in failed}
        if rank == 1 and step == KILL_AT_STEP:
            with open(kill_path, "w") as f:
                f.write(repr(time.time()))
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)  # a peer dies mid-training, without a word
        for kind, name, model in models:
            if (kind, name) in failed:
                continue
            started = time.time()
            try:
                opts[id(model)].zero_grad()
                out = outputs[id(model)] if kind == "FSDP" else model(x)
                nn.functional.mse_loss(out, y).backward()
                opts[id(model)].step()
            except Exception as exc:  # what we want after the kill: this step stops with the collective's error
                died = float(open(kill_path).read()) if os.path.exists(kill_path) else float("nan")
                failed[(kind, name)] = (step, time.time() - max(started, died), f"{type(exc).__name__}: {exc}")
    for (kind, name) in [(kind, name) for kind, name, _ in models]:
        step, seconds, message = failed.get((kind, name), (None, None, ""))
        results.put((rank, kind, name, step, seconds, message[:1500]))
    results.put((rank, "done", "", None, None, ""))
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.parametrize("world_size, ddp_cases, fsdp_cases", [
    (2, {**FLAT, **ONLINE}, FSDP),
    (3, {"bf16+fp32sum": FLAT["bf16+fp32sum"]}, {}),  # over three ranks: all-to-all, float32 sum, all-gather
    (4, TWO_LEVEL, {}),
], ids=["every-flat-format-and-fsdp", "float32-sum-three-ranks", "two-level"])
def test_survivors_stop_with_a_clear_message_when_a_peer_is_killed(world_size, ddp_cases, fsdp_cases):
    ctx = worker_context()
    results = ctx.Queue()
    survivors = [r for r in range(world_size) if r != 1]
    with tempfile.TemporaryDirectory() as tmp, scoped_env({"TRITON_INTERPRET": "0"}):
        store_path, kill_path = os.path.join(tmp, "store"), os.path.join(tmp, "killed")
        args = (world_size, store_path, kill_path, ddp_cases, fsdp_cases)
        procs = [ctx.Process(target=call_as_the_test_left_off,
                             args=(snapshot(_train_until_peer_dies, (r, *args)), results), daemon=True)
                 for r in range(world_size)]
        start(procs)
        reports, done = {}, set()
        deadline = time.monotonic() + RUN_SECONDS
        try:
            while done != set(survivors):
                try:
                    rank, kind, name, step, seconds, message = results.get(timeout=1.0)
                except queue.Empty:
                    crashed = [r for r in survivors if r not in done and procs[r].exitcode not in (None, 0)]
                    assert not crashed, f"survivors {crashed} died (exit codes {[procs[r].exitcode for r in crashed]})"
                    assert time.monotonic() < deadline, (
                        f"survivors {sorted(set(survivors) - done)} neither failed nor finished every format within "
                        f"{RUN_SECONDS} s (hang); reported: {reports}")
                    continue
                if kind == "done":
                    done.add(rank)
                else:
                    reports[(rank, kind, name)] = (step, seconds, message)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    assert procs[1].exitcode == -signal.SIGKILL
    expected = [(r, "DDP", name) for r in survivors for name in ddp_cases]
    expected += [(r, "FSDP", name) for r in survivors for name in fsdp_cases]
    assert sorted(reports) == sorted(expected)
    problems = []
    for (rank, kind, name), (step, seconds, message) in sorted(reports.items()):
        if kind == "DDP" and name in ONLINE:
            carried = r"(bucket \d+ \([^)]+ wire\)|the online tuner's timings)"
        elif kind == "DDP":
            carried = rf"bucket \d+ \({re.escape(name)} wire\)"
        else:
            carried = rf"the gradients of FSDP module .+ \({re.escape(name)} wire\)"
        told = (rf"ddp_triton: (all_reduce|all_to_all|all_gather|reduce_scatter)( between nodes)? of {carried} "
                rf"{re.escape(LOST_PEER)}.*The backend said: .*(peer|Connection)")
        problem = peer_death_problem(f"rank {rank}, {kind} {name}", step, seconds, message, told, KILL_AT_STEP,
                                     FAIL_SECONDS)
        if problem is not None:
            problems.append(problem)
    assert not problems, "\n".join(problems)
