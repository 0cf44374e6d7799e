"""A failed collective stops training on every surviving rank.

Tier: gloo multi-process on CPU, processes started here without an agent (as two nodes' torchrun agents would be:
nobody kills the survivors for us), plus a unit test of the hook's completion on a failed future.
"""

import os
import queue
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_triton.runtime.algo_groups import scoped_env
from ddp_triton.runtime.bucket import then_unpack
from dist_utils import call_as_the_test_left_off, snapshot, worker_context

# The survivor trains for at most this long; a fixed hook raises within a few seconds of the peer's death.
TRAIN_SECONDS = 30
KILL_AT_STEP = 20


def test_a_failed_all_reduce_fails_the_hook_future_and_skips_the_unpack():
    unpacked = []
    reduced = torch.futures.Future()
    done = then_unpack(reduced, lambda: unpacked.append(True), torch.zeros(3))
    reduced.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        done.wait()
    assert unpacked == []


def test_a_completed_all_reduce_unpacks_and_gives_the_buffer():
    buffer = torch.arange(3.0)
    unpacked = []
    reduced = torch.futures.Future()
    done = then_unpack(reduced, lambda: unpacked.append(True), buffer)
    reduced.set_result([buffer])
    assert done.wait() is buffer and unpacked == [True]


def _train_until_peer_dies(rank, world_size, store_path, options, results):
    os.environ["GROUP_RANK"] = str(rank // 2)  # two ranks per node (what torchrun tells each worker)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DDP(model, bucket_cap_mb=0.001)
    ddp_triton.register(ddp, **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    start, step = time.monotonic(), 0
    try:
        while time.monotonic() - start < TRAIN_SECONDS:
            if rank == 1 and step == KILL_AT_STEP:
                os.kill(os.getpid(), signal.SIGKILL)  # a peer dies mid-training, without a word
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            step += 1
        results.put((rank, "completed", step, ""))
    except Exception as exc:  # what we want: the survivor stops with the collective's error
        results.put((rank, "raised", step, f"{type(exc).__name__}: {exc}"[:500]))
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.parametrize("world_size, options", [
    (2, dict(comm_dtype=torch.bfloat16)), (2, dict(comm_dtype=torch.float32)),
    (2, dict(comm_dtype=torch.float8_e4m3fn)),  # all-to-all, float32 sum, all-gather: a chain of collectives
    # 2 nodes x 2 ranks: reduce-scatter in the node, FP8 between nodes, all-gather in the node: three groups
    (4, dict(comm_dtype=torch.float8_e4m3fn, hierarchical=True)),
    (4, dict(comm_dtype=torch.bfloat16, hierarchical=True)),
], ids=["cast", "in-place", "fp8-sharded", "two-level-fp8", "two-level-bf16"])
def test_survivors_stop_when_a_peer_is_killed(world_size, options):
    ctx = worker_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp, scoped_env({"TRITON_INTERPRET": "0"}):
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=call_as_the_test_left_off,
                             args=(snapshot(_train_until_peer_dies, (r, world_size, store_path, options)), results),
                             daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        reports = {}
        try:
            while len(reports) < world_size - 1:
                rank, outcome, step, message = results.get(timeout=TRAIN_SECONDS + 60)
                reports[rank] = (outcome, step, message)
        except queue.Empty:
            pytest.fail(f"survivors {sorted(set(range(world_size)) - {1} - set(reports))} neither raised nor "
                        "finished (hang)")
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    assert sorted(reports) == [r for r in range(world_size) if r != 1]
    assert procs[1].exitcode == -signal.SIGKILL
    for rank, (outcome, step, message) in reports.items():
        assert outcome == "raised", f"rank {rank} trained on alone for {step} steps after its peer died"
        assert KILL_AT_STEP <= step <= KILL_AT_STEP + 1, (rank, step)
        assert message, f"rank {rank}'s error says nothing"
