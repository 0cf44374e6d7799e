"""A bucket cut into chunks (``DDP_TRITON_CHUNK_BYTES``) trains to the same bits as the unchunked exchange.

Tier: gloo multi-process on CPU, on the kernels' torch path: flat FP8 with error feedback at 2 and 3 ranks, the
two-level formats at 2 nodes x 2 ranks (each worker told its node as torchrun tells it, ``GROUP_RANK``). Each worker
trains two copies of one model side by side, one state cut into chunks and one not, for several steps across DDP's
rebuild: the parameters must have the same bits after every step, and so must the error-feedback residuals each
state would checkpoint. The model's odd sizes put the parts' block boundaries at different offsets, so the chunks'
slots are padded.
"""

import copy
import itertools
import os
import types

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_helpers import local_backward, torch_path_workers
from ddp_triton.runtime.chunks import CHUNK_BYTES_ENV
from ddp_triton.runtime import telemetry
from ddp_triton.runtime.exchange import ChunkedExchange

LOCAL = 2  # ranks per node for the two-level exchange
STEPS = 4


class Odd(nn.Module):
    """Linear layers of odd widths (3,795 parameters): parameters that start off the 128-element grid."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(50, 37), nn.Linear(37, 41), nn.Linear(41, 8)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _data(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 50, generator=gen), torch.randn(12, 8, generator=gen)


def _state(ddp, options, chunk_bytes):
    os.environ[CHUNK_BYTES_ENV] = str(chunk_bytes)  # read when the state binds: here
    try:
        return ddp_triton.register(ddp, grad_stats=True, **options)
    finally:
        del os.environ[CHUNK_BYTES_ENV]


def _same_bits_worker(rank, world_size, options, chunk_bytes, bucket_cap_mb):
    os.environ["GROUP_RANK"] = str(rank // LOCAL)
    _ticking_clock()
    model = Odd()
    whole, cut = DDP(model, bucket_cap_mb=bucket_cap_mb), DDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
    whole_state, cut_state = _state(whole, options, 0), _state(cut, dict(options, timing=True), chunk_bytes)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (whole, cut)]
    for step in range(STEPS):
        x, y = _data(step)
        for ddp, opt in zip((whole, cut), optimizers):
            opt.zero_grad()
            local_backward(ddp, x, y, rank, world_size)
            opt.step()
        for (name, a), b in zip(whole.module.named_parameters(), cut.module.parameters()):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"step {step}: {name} differs"
        # The statistics: each chunk's unpack writes a row of its own, added up at the end, so the sum of squares
        # is added in another order than the unchunked unpack's: float32 rounding over about 4k terms, 1e-5.
        torch.testing.assert_close(cut_state.grad_norm(), whole_state.grad_norm(), rtol=1e-5, atol=0)
        assert torch.equal(cut_state.found_inf(), whole_state.found_inf())
        assert all(not isinstance(p.exchange, ChunkedExchange) for p in whole_state.latest_pass())
        counts = [len(p.exchange.chunks) for p in cut_state.latest_pass() if isinstance(p.exchange, ChunkedExchange)]
        assert counts and max(counts) > 2, counts
    assert cut_state.wire.name == whole_state.wire.name
    _check_telemetry(whole_state, cut_state)
    if whole_state.wire.error_feedback:
        saved, cut_saved = whole_state.state_dict(), cut_state.state_dict()
        # over two ranks (or two nodes) the sum is not requantized: no second-stage residuals
        over = world_size // LOCAL if whole_state.wire.two_level else world_size
        requantized = not whole_state.wire.one_all_gather(over)
        for stage in ("first_stage", "second_stage"):
            assert saved[stage].keys() == cut_saved[stage].keys()
            for name, value in saved[stage].items():
                assert torch.equal(value.view(torch.int16), cut_saved[stage][name].view(torch.int16)), (stage, name)
            there = any(value.abs().sum() > 0 for value in saved[stage].values())
            assert there == (stage == "first_stage" or requantized), stage  # residuals where a rounding leaves them


def _check_telemetry(whole_state, cut_state):
    """A chunked bucket's telemetry covers every chunk: its bytes are at least the whole bucket's (each chunk's
    slots are padded to whole shards: up to 1.4x here, where the chunks are a few blocks each), and its pack and
    unpack each span all chunks'. The clock is a tick counter here (``_ticking_clock``, a tick per mark taken): a
    span of K chunks' phases holds at least K - 1 ticks, one chunk's phase 1."""
    whole_bytes = whole_state.summary().wire_bytes_per_step
    cut_bytes = cut_state.summary().wire_bytes_per_step
    assert whole_bytes <= cut_bytes <= 1.5 * whole_bytes, (whole_bytes, cut_bytes)
    for plan in cut_state.latest_pass():
        if isinstance(plan.exchange, ChunkedExchange):
            count, marks = len(plan.exchange.chunks), plan.record.marks
            for phase in ("pack", "unpack"):
                assert marks[phase][1] - marks[phase][0] >= count - 1, (phase, count, marks)
            assert marks["pack"][0] < marks["comm"][0] < marks["unpack"][0] < marks["comm"][1] < marks["unpack"][1]


def _ticking_clock():
    """The telemetry's clock replaced by a counter: marks then say in which order they were taken."""
    ticks = itertools.count()
    telemetry.time = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)))


FP8 = dict(comm_dtype=torch.float8_e4m3fn)
FP4 = dict(comm_dtype="fp4e2m1+ef")


@pytest.mark.parametrize("world_size, options", [pytest.param(2, FP8, id="2-fp8e4m3+ef"),
                                                 pytest.param(3, FP8, id="3-fp8e4m3+ef"),
                                                 pytest.param(3, FP4, id="3-fp4e2m1+ef")])
def test_flat_block_scaled_chunks_keep_the_bits_and_residuals(world_size, options):
    """Chunks of 1 KiB of the bucket (about 4 blocks): one bucket, then one or two per layer after the rebuild."""
    for bucket_cap_mb in (25, 0.004):
        torch_path_workers(_same_bits_worker, world_size, options, 1024, bucket_cap_mb, timeout=180)


@pytest.mark.parametrize("options", [
    pytest.param(dict(FP8, hierarchical=True), id="fp8e4m3+ef"),
    pytest.param(dict(FP4, hierarchical=True), id="fp4e2m1+ef"),
    pytest.param(dict(comm_dtype=torch.float8_e5m2, error_feedback=False, hierarchical=True), id="fp8e5m2"),
    pytest.param(dict(comm_dtype=torch.bfloat16, hierarchical=True), id="bf16"),
    pytest.param(dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32, hierarchical=True),
                 id="bf16+fp32sum"),
])
def test_two_level_chunks_keep_the_bits_and_residuals(options):
    """2 nodes x 2 ranks, chunks of 1.5 KiB of the bucket: each part (about 1.9k elements) cut into 4 or 5."""
    torch_path_workers(_same_bits_worker, 2 * LOCAL, options, 1536, 25, timeout=180)


def _setting_worker(rank, world_size):
    os.environ[CHUNK_BYTES_ENV] = "4096" if rank == 0 else ""
    with pytest.raises(ValueError, match=f"ranks disagree on {CHUNK_BYTES_ENV} \\(4096, None; None: unset\\)"):
        ddp_triton.register(DDP(Odd()), comm_dtype=torch.float8_e4m3fn)
    os.environ[CHUNK_BYTES_ENV] = "1k" if rank == 1 else "1024"
    with pytest.raises(ValueError, match=f"({CHUNK_BYTES_ENV} must be a whole number of bytes|ranks disagree)"):
        ddp_triton.register(DDP(Odd()), comm_dtype=torch.float8_e4m3fn)


def test_ranks_that_set_the_chunk_size_differently_fail_together():
    torch_path_workers(_setting_worker, 2)
