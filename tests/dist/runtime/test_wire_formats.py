"""Wire formats under real DDP: 16 bits with float32 sums, block-scaled FP8 with and without error feedback, and
block-scaled E2M1 with error feedback.

Tier: gloo multi-process on CPU (world sizes 2, 3 and 4, spawned here), on the kernels' torch CPU path. Every rank
also computes every rank's local gradients on a copy of the model and averages them with the reference numerics of
``wire_reference.py`` (written from the formats' definitions): the hook must give the same bits, step after step,
residuals included, across DDP's bucket rebuild and a checkpoint.
"""

import copy
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from bits import assert_same_bits, bits
from ddp_helpers import local_backward, local_grads, torch_path_workers
from dist_utils import run_workers
from wire_reference import float32_sum_average, fp8_average
from ddp_triton.runtime.algo_groups import scoped_env
from ddp_triton.formats import WireFormat

BATCH = 12


class Wide(nn.Module):
    """Tensors of very different sizes and scales: a 2400-element weight (19 blocks, the last one short), a bias."""

    def __init__(self, dtype=torch.float32, unused=False):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 300)
        self.second = nn.Linear(300, 4)
        self.unused = nn.Linear(4, 4) if unused else None
        self.to(dtype)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x.to(self.first.weight.dtype)))).float()


def data(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=gen), torch.randn(BATCH, 4, generator=gen)


class Reference:
    """The same training on one process: every rank's gradients averaged with the reference numerics."""

    def __init__(self, model, options, world_size, lr=0.05):
        self.model, self.world_size = copy.deepcopy(model), world_size
        wire = WireFormat.from_options(**options)
        self.fmt, self.block_scaled, self.feedback = wire.comm_dtype, wire.block_scaled, wire.error_feedback
        params = list(self.model.parameters())
        self.first = [[torch.zeros_like(p, dtype=torch.float32) for p in params] for _ in range(world_size)]
        self.second = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        self.opt = torch.optim.SGD(params, lr=lr, momentum=0.9)

    def step(self, x, y, accumulate=1):
        per_rank = [local_grads(self.model, [(x, y)] * accumulate, r, self.world_size) for r in range(self.world_size)]
        if self.block_scaled:
            averaged = fp8_average(per_rank, self.fmt, self.first if self.feedback else None,
                                   self.second if self.feedback else None)
        else:
            averaged = float32_sum_average(per_rank, self.fmt)
        for p, g in zip(self.model.parameters(), averaged):
            p.grad = g.to(p.dtype)
        self.opt.step()


def assert_same_params(model, reference, step):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.detach().view(-1).view(torch.int16 if p.dtype != torch.float32 else torch.int32),
                           q.detach().view(-1).view(torch.int16 if q.dtype != torch.float32 else torch.int32)), \
            f"{name} differs from the reference after step {step}"


FP8_EF = dict(comm_dtype=torch.float8_e4m3fn)
FP8_E5M2_NO_EF = dict(comm_dtype=torch.float8_e5m2, error_feedback=False)
BF16_FP32_SUM = dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)
FP4_EF = dict(comm_dtype="fp4e2m1+ef")  # by its name: error feedback on, float32 sums


def train_like_reference(model, options, rank, world_size, steps, accumulate=1, group=None, data_shift=0,
                         **ddp_kwargs):
    """Train ``model`` under DDP with the hook for ``steps`` steps, checking its bits against the reference's after
    each (``accumulate`` micro-batches per step, all but the last under no_sync). Returns the state."""
    reference = Reference(model, options, world_size)
    ddp = DDP(model, process_group=group, **ddp_kwargs)
    state = ddp_triton.register(ddp, **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = data(step + data_shift)
        opt.zero_grad()
        with ddp.no_sync():
            for _ in range(accumulate - 1):
                local_backward(ddp, x, y, rank, world_size)
        local_backward(ddp, x, y, rank, world_size)
        opt.step()
        reference.step(x, y, accumulate)
        assert_same_params(ddp.module, reference.model, step)
    return state


def _same_bits_worker(rank, world_size, options, bucket_cap_mb, static_graph):
    # Step 0 in DDP's constructor bucket order, then the rebuilt order.
    state = train_like_reference(Wide(), options, rank, world_size, 4, bucket_cap_mb=bucket_cap_mb,
                                 static_graph=static_graph)
    assert state.passes == 4
    # The summary names the format and counts what each bucket's exchange handed to the wire.
    summary = state.summary()
    live = [e for e in state.plans.values() if e.record.last_used == state.passes - 1]
    assert summary.wire_bytes_per_step == sum(e.exchange.send.numel() * e.exchange.send.element_size() for e in live)
    assert all(set(b.wire_bytes) == {state.wire.name} for b in summary.buckets), str(summary)
    wire = WireFormat.from_options(**options)
    # 132/128 bytes per element for FP8 (0.26x float32's), 68/128 for E2M1 (0.13x), 2 for bf16 (0.5x), plus the
    # padding of each tensor's last block and of each bucket to N rows, which on this small model adds up to 0.05x.
    assert summary.wire_bytes_per_step < summary.fp32_bytes_per_step * (wire.bytes_per_element / 4 + 0.05), \
        str(summary)


def _every_format_worker(rank, world_size):
    # Over two ranks bf16 with float32 sums is one bf16 all-reduce (the no_sync / unused parameters test's).
    for options in (FP8_EF, FP8_E5M2_NO_EF, FP4_EF) + ((BF16_FP32_SUM,) if world_size > 2 else ()):
        _same_bits_worker(rank, world_size, options, 0.002, False)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_same_bits_as_the_reference_several_buckets(world_size):
    """FP8 E4M3 with error feedback, E5M2 without, E2M1 with error feedback, bf16 with float32 sums (from 3 ranks);
    one bucket per tensor or so."""
    torch_path_workers(_every_format_worker, world_size)


def _one_bucket_worker(rank, world_size):
    for static_graph in (False, True):
        _same_bits_worker(rank, world_size, FP8_EF, 25, static_graph)


def test_same_bits_one_bucket_across_the_rebuild_and_with_static_graph():
    """One bucket: DDP's rebuild after step 0 reverses its parameter order, the FP8 residuals must follow."""
    torch_path_workers(_one_bucket_worker, 3)


def resume_matches_unbroken(rank, world_size, tmp, options, bucket_cap_mb=25, inspect=None):
    """Train 6 steps unbroken; then 3, save model, optimizer and residuals (``inspect(saved)`` looks at them), load
    them into a fresh DDP model (constructor bucket order again) and train 3 more: the same bits. Returns the
    checkpoint."""
    def fresh():
        model = Wide()
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
        state = ddp_triton.register(ddp, **options)
        return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    def train(ddp, opt, steps):
        for step in steps:
            x, y = data(step)
            opt.zero_grad()
            local_backward(ddp, x, y, rank, world_size)
            opt.step()

    model, ddp, state, opt = fresh()
    train(ddp, opt, range(6))
    unbroken = [p.detach().clone() for p in model.parameters()]

    model, ddp, state, opt = fresh()
    train(ddp, opt, range(3))
    path = os.path.join(tmp, f"rank{rank}.pt")
    saved = state.state_dict()
    if inspect is not None:
        inspect(saved)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": saved}, path)

    model, ddp, state, opt = fresh()
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    state.load_state_dict(checkpoint["hook"])
    train(ddp, opt, range(3, 6))
    for name, p, q in zip([n for n, _ in model.named_parameters()], model.parameters(), unbroken):
        assert torch.equal(p.detach().view(torch.int32), q.view(torch.int32)), f"{name} differs after resuming"
    return checkpoint


def _some_residuals(saved):
    assert saved["first_stage"] and saved["second_stage"], "error feedback left nothing to save"
    assert any(t.abs().sum() > 0 for t in saved["second_stage"].values())


def _checkpoint_worker(rank, world_size, tmp, options):
    resume_matches_unbroken(rank, world_size, tmp, options, inspect=_some_residuals)


@pytest.mark.parametrize("options", [pytest.param(FP8_EF, id="fp8e4m3+ef"), pytest.param(FP4_EF, id="fp4e2m1+ef")])
def test_checkpoint_resumes_bit_identically(tmp_path, options):
    torch_path_workers(_checkpoint_worker, 3, str(tmp_path), options)


def _features_worker(rank, world_size):
    for options in (FP8_EF, BF16_FP32_SUM, FP4_EF):
        _features_of(rank, world_size, options)


def _features_of(rank, world_size, options):
    """no_sync accumulation, find_unused_parameters and a bfloat16 model, each against the reference's bits."""
    # no_sync: two micro-batches, the second synchronising.
    train_like_reference(Wide(), options, rank, world_size, 2, accumulate=2, bucket_cap_mb=0.002)
    # find_unused_parameters: the unused layer's gradients are averaged as zeros.
    train_like_reference(Wide(unused=True), options, rank, world_size, 2, bucket_cap_mb=0.002,
                         find_unused_parameters=True)
    # A bfloat16 model: the average is rounded once into the bfloat16 gradients.
    train_like_reference(Wide(dtype=torch.bfloat16), options, rank, world_size, 2, bucket_cap_mb=0.002)


def test_no_sync_unused_parameters_and_bfloat16_models():
    torch_path_workers(_features_worker, 2)


def _join_and_subgroup_worker(rank, world_size):
    for options in (FP8_EF, BF16_FP32_SUM):
        _join_and_subgroup_of(rank, world_size, options)


def _join_and_subgroup_of(rank, world_size, options):
    # Uneven inputs under join(): joined ranks take part in the same all-to-alls and all-gathers with zeros.
    model = Wide()
    ddp = DDP(model, bucket_cap_mb=0.002)
    ddp_triton.register(ddp, **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with ddp.join():
        for step in range(2 + rank):
            x, y = data(step)
            opt.zero_grad()
            local_backward(ddp, x, y, rank, world_size)
            opt.step()
    flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, flat) for g in gathered), "the ranks' models differ after join()"
    assert torch.isfinite(flat).all()
    # Two subgroups of two: each averages over its own ranks only, to the reference's bits; the two groups train
    # on different data.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    train_like_reference(Wide(), options, rank % 2, 2, 2, group=groups[rank // 2], data_shift=10 * (rank // 2),
                         bucket_cap_mb=0.002)


def test_join_and_subgroups():
    torch_path_workers(_join_and_subgroup_worker, 4)


def _interpreter_worker(rank, world_size):
    from ddp_triton.kernels import uses_triton

    assert uses_triton(torch.device("cpu")), "this worker should run the Triton kernels in the interpreter"
    # FP8 runs all three block kernels; the float32 sum of slices is checked on its own in test_wire_kernels.py.
    _same_bits_worker(rank, world_size, FP8_EF, 0.002, False)


def test_wire_format_kernels_end_to_end_under_interpreter():
    from interpreter import interpreter_problem

    if interpreter_problem() is not None:
        pytest.skip(interpreter_problem())
    with scoped_env({"TRITON_INTERPRET": "1"}):
        run_workers(_interpreter_worker, 2, timeout=240)


# ---- settings -----------------------------------------------------------------------------------------------------


def test_wire_format_names_and_bad_combinations():
    assert WireFormat.from_options(torch.bfloat16).name == "bf16"
    assert WireFormat.from_options(torch.bfloat16, torch.float32).name == "bf16+fp32sum"
    assert WireFormat.from_options(torch.float32, torch.float32).name == "fp32"  # float32 already sums in float32
    assert WireFormat.from_options(torch.float8_e4m3fn).name == "fp8e4m3+ef"
    assert WireFormat.from_options(torch.float8_e5m2, error_feedback=False).name == "fp8e5m2"
    with pytest.raises(ValueError, match="error_feedback applies to FP8"):
        WireFormat.from_options(torch.bfloat16, error_feedback=True)
    with pytest.raises(ValueError, match="accumulate_dtype must be"):
        WireFormat.from_options(torch.bfloat16, torch.float64)
    with pytest.raises(ValueError, match="comm_dtype must be one of"):
        WireFormat.from_options(torch.int8)
    with pytest.raises(ValueError, match="accumulate_dtype must be"):
        ddp_triton.CommState(comm_dtype=torch.float8_e4m3fn, accumulate_dtype=torch.bfloat16)
    # A format's name as comm_dtype: the state's format, and the options that contradict it refused by name.
    assert ddp_triton.CommState(comm_dtype="fp4e2m1+ef").wire.name == "fp4e2m1+ef"
    assert ddp_triton.CommState(comm_dtype="fp4e2m1+ef", hierarchical=True).wire.name == "two-level fp4e2m1+ef"
    with pytest.raises(ValueError, match="comm_dtype: wire format 'fp4e2m1\\+fp32sum\\+ef': \\+fp32sum is for bf16"):
        ddp_triton.CommState(comm_dtype="fp4e2m1+fp32sum+ef")
    with pytest.raises(ValueError, match="says error feedback is on, error_feedback=False"):
        ddp_triton.CommState(comm_dtype="fp4e2m1+ef", error_feedback=False)


class Given(nn.Module):
    """One parameter whose gradient is ``grad`` on every backward: a rank's gradients chosen value by value."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.grad_values = torch.zeros(n)

    def forward(self):
        return (self.weight * self.grad_values).sum()


def _two_ranks_worker(rank, world_size):
    """Over two ranks the 16-bit formats with float32 sums travel as one all-reduce, with the definition's bits:
    ties to even, a -0.0 from both ranks, values far apart, subnormal ones, and random ones."""
    from ddp_triton.formats import average_factors

    for wire, tie in ((torch.bfloat16, 2.0 ** -7), (torch.float16, 2.0 ** -10)):
        gen = torch.Generator().manual_seed(7)
        randoms = [torch.randn(4000, generator=gen) * 10.0 ** torch.randint(-6, 4, (4000,), generator=gen)
                   for _ in range(2)]
        special = [torch.tensor([2.0, -0.0, 2.0, 1.0, 3e-5, 6e-8, 1e4, -2.0]),
                   torch.tensor([tie, -0.0, 3 * tie, 1e-4, -1e-5, 6e-8, -1.0, tie])]
        per_rank = [torch.cat([special[r], randoms[r]]) for r in range(2)]
        model = Given(per_rank[0].numel())
        model.grad_values = per_rank[rank]
        ddp = DDP(model)
        state = ddp_triton.register(ddp, comm_dtype=wire, accumulate_dtype=torch.float32)
        for _ in range(2):  # DDP's first bucket order, then the rebuilt one
            model.weight.grad = None
            ddp().backward()
        pre, post = average_factors(2, wire)
        sent = [(g * pre).to(wire).float() for g in per_rank]
        want = (sent[0] + sent[1]).to(wire).float() * post
        assert_same_bits(model.weight.grad, want)
        assert bits(model.weight.grad)[1].item() == bits(torch.tensor([-0.0])).item()
        summary = state.summary()
        assert [b.wire_format for b in summary.buckets] == [state.wire.name], str(summary)
        assert {e.record.collectives_per_pass for e in state.plans.values()} == {1}  # no all-to-all, no all-gather
        assert summary.wire_bytes_per_step == per_rank[0].numel() * 2  # the all-reduce of the 16-bit bucket


def _round_to_bf16(x):
    """float64 -> the nearest bfloat16 (ties to even), by integer operations on the bits: one rounding."""
    bits = x.view(np.int64)
    keep = (bits >> 45) + (((bits >> 44) & 1) & (((bits & ((1 << 44) - 1)) != 0) | ((bits >> 45) & 1)))
    return (keep << 45).view(np.float64)


def test_a_float32_sum_of_two_16_bit_values_rounds_as_their_exact_sum():
    """What makes the two-rank all-reduce the same bits: rounding the float32 sum of two 16-bit values to 16 bits
    gives their exact sum correctly rounded (float64 holds it exactly; numpy rounds float64 to float16 once, and
    bfloat16 is rounded on the bits here). Random bit patterns, and pairs one just under a tie apart."""
    rng = np.random.default_rng(0)
    n = 400_000
    a = rng.integers(0, 1 << 16, n, dtype=np.uint16).view(np.float16)
    b = rng.integers(0, 1 << 16, n, dtype=np.uint16).view(np.float16)
    near = n // 2  # b about half a unit in a's last place, give or take a few units of float32
    b[:near] = (a[:near].astype(np.float64) * np.ldexp(1.0, -rng.integers(10, 14, near).astype(np.int32))
                * rng.choice([-1.0, 1.0], near) * (1 + rng.integers(0, 4, near) * 2.0 ** -10)).astype(np.float16)
    finite = np.isfinite(a) & np.isfinite(b)
    exact = (a.astype(np.float64) + b.astype(np.float64)).astype(np.float16)
    via32 = torch.from_numpy(a.astype(np.float32) + b.astype(np.float32)).to(torch.float16).numpy()
    assert np.array_equal(exact.view(np.uint16)[finite], via32.view(np.uint16)[finite])
    # bfloat16: values over a wide exponent range, the second 0 to 30 binades below the first
    exponent, gap = rng.integers(-90, 100, n), rng.integers(0, 30, n)  # no sum below bf16's normal range
    x = np.ldexp(1 + rng.integers(0, 128, n) / 128.0, exponent) * rng.choice([-1.0, 1.0], n)
    y = np.ldexp(1 + rng.integers(0, 128, n) / 128.0, exponent - gap) * rng.choice([-1.0, 1.0], n)
    ta, tb = torch.from_numpy(x).float().bfloat16(), torch.from_numpy(y).float().bfloat16()
    total = ta.double().numpy() + tb.double().numpy()
    assert np.array_equal(_round_to_bf16(total), (ta.float() + tb.float()).bfloat16().double().numpy())


def test_at_two_ranks_float32_sums_are_one_all_reduce_with_the_same_bits():
    torch_path_workers(_two_ranks_worker, 2)


@pytest.mark.parametrize("world_size", [2, 3, 64])
def test_exchange_buffers_are_what_the_cost_model_prices(world_size):
    """The bytes a bucket's exchange hands to the all-to-all and the all-gather, from the buffers the runtime really
    allocates, are the messages ``autotune --model-only --wire-formats`` prices; FP8 sends 132/256 of bf16's."""
    import ddp_triton.machine.cost_model as cm
    from ddp_triton.kernels import block_layout
    from ddp_triton.runtime.wire_exchanges import block_fp8_exchange, float32_sum_exchange

    n = 1_000_003  # one tensor, a prime number of elements: both kinds of padding happen
    bucket = torch.zeros(n)
    fp8 = WireFormat.from_options(torch.float8_e4m3fn)
    fp4 = WireFormat.from_options("fp4e2m1+ef")
    bf16 = WireFormat.from_options(torch.bfloat16, torch.float32)
    exchanges = {
        fp8.name: block_fp8_exchange(bucket, fp8, block_layout([n], world_size), None, world_size, 1.0, None, None),
        fp4.name: block_fp8_exchange(bucket, fp4, block_layout([n], world_size), None, world_size, 1.0, None, None),
        bf16.name: float32_sum_exchange(bucket, bf16, None, world_size, 1.0, 1.0, None),
    }
    for name, exchange in exchanges.items():
        model = dict(cm.wire_collectives(n, name, world_size))
        if bf16.one_all_reduce(world_size) and name == bf16.name:  # the runtime sends it as one all-reduce
            assert model == {"all_reduce": n * 2}
            continue
        nbytes = exchange.send.numel() * exchange.send.element_size()
        if WireFormat.from_options(name).one_all_gather(world_size):  # every rank's whole rows, one all-gather
            assert model == {"all_gather": world_size * nbytes} and exchange.collective_bytes() == (nbytes, 0)
            assert exchange.recv.numel() == world_size * nbytes
            continue
        assert model["all_to_all"] == nbytes == world_size * exchange.shard.numel() * exchange.shard.element_size()
        assert model["all_gather"] == nbytes
    ratio = cm.wire_bytes(n, fp8.name, world_size) / cm.wire_bytes(n, bf16.name, world_size)
    # Padding: the tensor's short last block and up to N - 1 empty rows, together under N rows of 128 elements.
    assert 132 / 256 <= ratio < 132 / 256 * (1 + world_size * 128 / n)
    assert cm.wire_bytes(n, fp4.name, world_size) * 132 == cm.wire_bytes(n, fp8.name, world_size) * 68  # same rows


def _disagreement_worker(rank, world_size):
    # Rank 0 asks for FP8, rank 1 for bf16: an all-to-all against an all-reduce would hang or abort in gloo. Both
    # must fail at binding, with the same message.
    options = FP8_EF if rank == 0 else dict(comm_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"ranks disagree on the wire format \(rank 0: fp8e4m3\+ef; rank 1: bf16\)"):
        ddp_triton.register(DDP(Wide()), **options)


def test_ranks_that_disagree_on_the_wire_format_fail_together():
    torch_path_workers(_disagreement_worker, 2)


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "two-level"])
def test_an_fp8_bucket_without_its_parameters_is_refused_before_anything_binds(hierarchical):
    from ddp_triton.runtime.context import Context
    from ddp_triton.runtime.exchange import ExchangeQueue
    from ddp_triton.runtime.plan import plan_bucket
    from ddp_triton.runtime.residuals import ResidualStore

    store = ResidualStore()
    wire = WireFormat.from_options(torch.float8_e4m3fn, hierarchical=hierarchical)
    context = Context(group=None, world_size=2, backend="gloo", wire=wire, formats=None, profile=None,
                      algorithm_groups={}, nodes=None, queue=ExchangeQueue(), residuals=store, grad_stats=False)
    with pytest.raises(ValueError, match="needs the bucket's parameters, got 0 covering 0 of 10 elements"):
        plan_bucket(torch.zeros(10), None, context)
    assert not store.layouts


def _block_scaled_two_ranks_worker(rank, world_size, name, dtype, chunk_bytes):
    """Over two ranks a block-scaled bucket travels as one all-gather of each rank's whole rows (one per chunk), and
    DDP's bucket holds the float32 sum, in rank order, of the two ranks' dequantized values rounded once to its
    dtype: no requantized sum, so no second rounding."""
    import ddp_triton.runtime.wire_exchanges as wire_exchanges
    from ddp_triton.runtime.chunks import CHUNK_BYTES_ENV
    from wire_reference import quantize_dequantize

    fmt = WireFormat.from_options(name).comm_dtype
    gen = torch.Generator().manual_seed(11)
    n = 128 * 40 + 57  # 41 blocks, the last one short
    per_rank = [(torch.randn(n, generator=gen) * 10.0 ** torch.randint(-4, 3, (n,), generator=gen)).to(dtype)
                for _ in range(2)]
    model = Given(n).to(dtype)
    model.grad_values = per_rank[rank]
    ddp = DDP(model)
    calls = {"all_gather": 0, "all_to_all": 0}
    gather, all_to_all = wire_exchanges.all_gather_into, dist.all_to_all_single

    def counted(kind, collective):
        def call(*args, **kwargs):
            calls[kind] += 1
            return collective(*args, **kwargs)
        return call

    os.environ[CHUNK_BYTES_ENV] = str(chunk_bytes)  # read when the state binds: at register
    try:
        state = ddp_triton.register(ddp, comm_dtype=name, grad_stats=True)
    finally:
        del os.environ[CHUNK_BYTES_ENV]
    wire_exchanges.all_gather_into = counted("all_gather", gather)
    dist.all_to_all_single = counted("all_to_all", all_to_all)
    try:
        ddp().backward()  # the first step: the residuals are zero
    finally:
        wire_exchanges.all_gather_into, dist.all_to_all_single = gather, all_to_all
    sent = [quantize_dequantize(g.float() * 0.5, fmt) for g in per_rank]
    want = (sent[0] + sent[1]).to(dtype)
    assert not torch.equal(want.float(), quantize_dequantize(want.float(), fmt))  # a second rounding would show
    assert_same_bits(model.weight.grad, want)
    chunks = {e.record.collectives_per_pass for e in state.plans.values()}
    assert calls == {"all_gather": sum(chunks), "all_to_all": 0} and (chunks == {1}) == (chunk_bytes == 0), calls
    # the statistics of what was stored: float32 sums of squares in an order of the kernels' own, 1e-5 apart at most
    torch.testing.assert_close(state.grad_norm().double(), want.double().norm(), rtol=1e-5, atol=0)
    summary = state.summary()
    row = 132 if name.startswith("fp8") else 68
    # every row once: 41 blocks, each chunk's rows padded to an even count (one empty row for the whole bucket)
    count = sum(chunks)
    assert summary.wire_bytes_per_step % (2 * row) == 0, str(summary)
    assert 42 * row <= summary.wire_bytes_per_step <= (41 + count) * row, str(summary)
    if count == 1:
        assert summary.wire_bytes_per_step == 42 * row, str(summary)


@pytest.mark.parametrize("name, dtype, chunk_bytes", [
    pytest.param("fp8e4m3+ef", torch.float32, 0, id="fp8-float32"),
    pytest.param("fp4e2m1+ef", torch.float32, 0, id="fp4-float32"),
    pytest.param("fp4e2m1+ef", torch.bfloat16, 0, id="fp4-bfloat16"),
    pytest.param("fp8e4m3+ef", torch.float32, 1024, id="fp8-chunks"),
])
def test_at_two_ranks_block_scaled_is_one_all_gather_and_one_rounding(name, dtype, chunk_bytes):
    torch_path_workers(_block_scaled_two_ranks_worker, 2, name, dtype, chunk_bytes)
