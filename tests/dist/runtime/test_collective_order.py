"""Every rank issues a state's collectives in one order, whichever rank is late and however DDP re-buckets.

Tier: gloo multi-process on CPU (2 and 3 ranks), on the kernels' torch path. Each worker records every collective
it issues through ``torch.distributed`` (kind, group size, element count), in issue order, while it trains models
whose parameters are used in another order than they were registered, so that DDP's bucket rebuild after the first
step changes the bucket layouts (the FP8 residuals are re-sliced with a collective of their own then), and whose
ranks are slowed down at random points of the backward. The ranks' records must be equal, and every run must end
within the workers' time limit; also with buckets cut into chunks (``DDP_TRITON_CHUNK_BYTES``).
"""

import os
import random
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_triton.runtime import two_level, wire_exchanges
from ddp_triton.runtime.algo_groups import scoped_env
from ddp_triton.runtime.chunks import CHUNK_BYTES_ENV
from ddp_triton.runtime.exchange import ChunkedExchange
from dist_utils import run_workers

LAYERS = 8
WIDTH = 128  # 16.5k parameters a layer: two layers to a bucket under the cap below
BUCKET_CAP_MB = 0.15
STEPS = 3  # step 0 in the constructor's bucket order, then the rebuilt one

_RECORDED = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather_single", "broadcast",
             "all_gather", "reduce_scatter_tensor", "reduce_scatter_single", "barrier")


class Recorder:
    """Wraps ``torch.distributed``'s collectives (and the exchange's all-gather) to note each call as issued."""

    def __init__(self) -> None:
        self.calls = []
        self._lock = threading.Lock()
        self._saved = []

    def _wrap(self, owner, name):
        real = getattr(owner, name)

        def recorded(*args, **kwargs):
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            group = kwargs.get("group")
            with self._lock:
                self.calls.append((name if owner is dist else "exchange." + name,
                                   (tuple(dist.get_process_group_ranks(group)), group.group_name)
                                   if group is not None else None,
                                   None if tensor is None else tensor.numel()))
            return real(*args, **kwargs)

        self._saved.append((owner, name, real))
        setattr(owner, name, recorded)

    def __enter__(self):
        for name in _RECORDED:
            if hasattr(dist, name):
                self._wrap(dist, name)
        self._wrap(wire_exchanges, "all_gather_into")
        self._wrap(two_level, "all_gather_into")
        return self

    def __exit__(self, *exc):
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)


class Straggle(torch.autograd.Function):
    """Identity whose backward sleeps: a rank late at that point of its backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.seconds:
            time.sleep(ctx.seconds)
        return grad, None


class Shuffled(nn.Module):
    """Linear layers used in ``order``, not in the order they were registered; ``delays[i]`` after layer i."""

    def __init__(self, order):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.order = order
        self.delays = [0.0] * LAYERS

    def forward(self, x):
        for i in self.order:
            x = Straggle.apply(torch.tanh(self.layers[i](x)), self.delays[i])
        return x


def _bucket_kwargs():
    if "bucket_cap_mb_list" in DDP.__init__.__code__.co_varnames:  # torch >= 2.13: several constructor buckets too
        return dict(bucket_cap_mb_list=[BUCKET_CAP_MB] * LAYERS)
    return dict(bucket_cap_mb=BUCKET_CAP_MB)


def _order_worker(rank, world_size, options, trials, chunk_bytes=0):
    os.environ["GROUP_RANK"] = str(rank // 2)  # two ranks per node, for the two-level exchange
    os.environ[CHUNK_BYTES_ENV] = str(chunk_bytes)  # 0: buckets whole; else chunks of that many bytes of a bucket
    for trial in range(trials):
        shared = random.Random(trial)  # the same model on every rank
        order = list(range(LAYERS))
        shared.shuffle(order)
        late = random.Random(1000 * trial + rank)  # each rank late in its own places
        model = Shuffled(order)
        ddp = DDP(model, **_bucket_kwargs())
        state = ddp_triton.register(ddp, **options)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        with Recorder() as recorder:
            for step in range(STEPS):
                model.delays = [late.choice((0.0, 0.0, 0.02, 0.08)) for _ in range(LAYERS)]
                opt.zero_grad()
                ddp(torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))).sum().backward()
                opt.step()
        cut = [len(p.exchange.chunks) for p in state.latest_pass() if isinstance(p.exchange, ChunkedExchange)]
        assert bool(cut) == bool(chunk_bytes), cut
        records = [None] * world_size
        dist.all_gather_object(records, recorder.calls)
        if options.get("hierarchical"):  # node and cross groups: each group's members issue its calls in one order
            groups = {group for calls in records for _, group, _ in calls}
            # 2 nodes with 2 groups each (reduce-scatters, all-gathers), 2 cross groups, and the world
            pairs = sorted(ranks for ranks, _ in groups - {None} if len(ranks) == 2)
            assert pairs == [(0, 1), (0, 1), (0, 2), (1, 3), (2, 3), (2, 3)], groups
            for group in groups:
                members = tuple(range(world_size)) if group is None else group[0]
                on_group = [[c for c in records[r] if c[1] == group] for r in members]
                for r, calls in zip(members, on_group):
                    assert calls == on_group[0], (f"trial {trial} ({options}): rank {r} issued its collectives on "
                                                  f"group {group} in another order than rank {members[0]}")
        else:
            for other, calls in enumerate(records):
                assert calls == records[0], (f"trial {trial} ({options}): rank {other} issued its collectives in "
                                             f"another order than rank 0:\n{calls}\n{records[0]}")
        kinds = {name for name, _, _ in recorder.calls}
        over = world_size // 2 if options.get("hierarchical") else world_size  # what the format's exchange spans
        if state.wire.one_all_gather(over):  # two ranks or nodes: each rank's whole rows in one all-gather
            assert "all_to_all_single" not in kinds and "exchange.all_gather_into" in kinds, kinds
        else:
            assert "all_to_all_single" in kinds or options.get("comm_dtype") == torch.bfloat16, kinds
        if options.get("comm_dtype") == torch.float8_e4m3fn:
            assert "all_reduce" in kinds, f"no residual re-slice happened: the bucket layouts did not change {kinds}"


def test_two_level_collectives_in_one_order_per_group_under_stragglers_and_a_rebuild():
    """2 nodes x 2 ranks: the node group's reduce-scatter and all-gather, the cross group's exchange; buckets whole
    and cut into chunks of 16 KiB (8 or 9 a bucket: each group's collectives chunk by chunk)."""
    with scoped_env({"TRITON_INTERPRET": "0"}):
        for options, trials, chunk_bytes in ((dict(comm_dtype=torch.float8_e4m3fn, hierarchical=True), 2, 0),
                                             (dict(comm_dtype=torch.bfloat16, hierarchical=True), 1, 0),
                                             (dict(comm_dtype=torch.float8_e4m3fn, hierarchical=True), 2, 16384)):
            run_workers(_order_worker, 4, options, trials, chunk_bytes, timeout=120)


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_in_one_order_under_stragglers_and_a_rebuild(world_size):
    """FP8 with error feedback (its residuals re-slice at the rebuild), whole and in chunks of 16 KiB, and bf16 with
    float32 sums."""
    with scoped_env({"TRITON_INTERPRET": "0"}):
        for options, trials, chunk_bytes in ((dict(comm_dtype=torch.float8_e4m3fn), 3, 0),
                                             (dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32), 1, 0),
                                             (dict(comm_dtype=torch.float8_e4m3fn), 2, 16384)):
            run_workers(_order_worker, world_size, options, trials, chunk_bytes, timeout=90)
