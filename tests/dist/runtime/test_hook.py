"""triton_hook and CommState under real DDP.

Tier: gloo multi-process on CPU (world sizes 2 and 4, spawned here). Most tests run the torch CPU path of the
kernels (TRITON_INTERPRET=0 in the workers, as in CPU production); the interpreter test runs the Triton kernel end
to end. The reference is always a plain single process on the full batch (the DDP equivalence).
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_helpers import (FP32_TOL, Branchy, TwoDtypes, assert_params_close, local_backward, local_slice,
                         make_data, make_model, torch_path_workers, train_ddp, train_reference)
from dist_utils import run_workers
from interpreter import interpreter_problem
from ddp_triton.runtime.algo_groups import scoped_env
from ddp_triton.formats import average_factors

def torch_bf16_hook(state, bucket):
    """torch's bf16_compress_hook itself. DDP refuses it by name outside NCCL, though it runs fine on gloo (which
    all-reduces bfloat16), so the comparison tests call it under another name."""
    return default_hooks.bf16_compress_hook(state, bucket)


def torch_fp16_hook(state, bucket):
    """torch's fp16_compress_hook, under another name for the same reason as torch_bf16_hook."""
    return default_hooks.fp16_compress_hook(state, bucket)


def _equivalence_worker(rank, world_size, gabv, bucket_cap_mb, static_graph):
    model = make_model()
    reference = train_reference(copy.deepcopy(model), steps=6)
    ddp = DDP(model, gradient_as_bucket_view=gabv, bucket_cap_mb=bucket_cap_mb, static_graph=static_graph)
    state = ddp_triton.register(ddp, comm_dtype=torch.float32)
    train_ddp(ddp, rank, world_size, steps=6)
    assert_params_close(ddp.module, reference, **FP32_TOL)
    if bucket_cap_mb < 0.01:
        assert len(state.plans) > 1, "the small bucket cap should give several buckets"


# Copied-out gradients at world size 2, bucket views at 2 and 4: world size 4 with copies adds no path (CI time).
@pytest.mark.parametrize("world_size,gabv", [(2, False), (2, True), (4, True)], ids=["copy-2", "bucket-view-2",
                                                                                   "bucket-view-4"])
def test_ddp_equivalence_float32(world_size, gabv):
    torch_path_workers(_equivalence_worker, world_size, gabv, 0.002, False)


@pytest.mark.parametrize("world_size", [4])
def test_ddp_equivalence_static_graph(world_size):
    torch_path_workers(_equivalence_worker, world_size, True, 0.002, True)


def _interpreter_worker(rank, world_size):
    from ddp_triton.kernels import uses_triton

    assert uses_triton(torch.device("cpu")), "this worker should run the Triton kernel in the interpreter"
    _equivalence_worker(rank, world_size, True, 0.002, False)
    # and bfloat16 through the same kernel, against torch's own bf16 hook on the same data
    _bf16_error_worker(rank, world_size)


@pytest.mark.skipif(interpreter_problem() is not None, reason=str(interpreter_problem()))
def test_triton_kernel_end_to_end_under_interpreter():
    with scoped_env({"TRITON_INTERPRET": "1"}):
        run_workers(_interpreter_worker, 2, timeout=240)


def _grad_error(model_fn, hook, state, rank, world_size, reference_grads):
    model = model_fn()
    ddp = DDP(model, bucket_cap_mb=0.002)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    x, y = make_data(0)
    local_backward(ddp, x, y, rank, world_size)
    return math.sqrt(sum(float((p.grad.double() - r).square().sum()) for p, r in zip(model.parameters(),
                                                                                     reference_grads)))


def _bf16_error_worker(rank, world_size):
    # float64 reference of the averaged gradient: the full-batch gradient of a float64 copy
    reference = make_model().double()
    x, y = make_data(0)
    nn.functional.mse_loss(reference(x.double()), y.double()).backward()
    reference_grads = [p.grad for p in reference.parameters()]
    ours = _grad_error(make_model, ddp_triton.triton_hook, None, rank, world_size, reference_grads)
    theirs = _grad_error(make_model, torch_bf16_hook, None, rank, world_size, reference_grads)
    assert ours <= theirs, f"triton_hook error {ours:.3e} > bf16_compress_hook error {theirs:.3e}"
    assert ours > 0  # bfloat16 did round something: the comparison is not vacuous


@pytest.mark.parametrize("world_size", [2, 4])
def test_bf16_error_no_worse_than_torch_bf16_hook(world_size):
    torch_path_workers(_bf16_error_worker, world_size)


def _no_sync_worker(rank, world_size):
    model = make_model()
    reference = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.002)
    ddp_triton.register(ddp, comm_dtype=torch.float32)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        micro = [make_data(10 * step + m) for m in range(2)]
        opt_ref.zero_grad()
        for x, y in micro:  # reference: accumulate the two full-batch micro-steps
            nn.functional.mse_loss(reference(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        with ddp.no_sync():
            x, y = micro[0]
            local_backward(ddp, x, y, rank, world_size)
        x, y = micro[1]
        local_backward(ddp, x, y, rank, world_size)
        opt.step()
    assert_params_close(ddp.module, reference, **FP32_TOL)


# world size 2 (and 3) of the default bfloat16 path: test_default_path_bits.py
@pytest.mark.parametrize("world_size", [4])
def test_gradient_accumulation_with_no_sync(world_size):
    torch_path_workers(_no_sync_worker, world_size)


def _unused_parameters_worker(rank, world_size):
    model = Branchy()
    reference = copy.deepcopy(model)
    ddp = DDP(model, find_unused_parameters=True)
    ddp_triton.register(ddp, comm_dtype=torch.float32)
    opt, opt_ref = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        model.use_branch = reference.use_branch = step % 2 == 0
        x, y = make_data(step)
        opt_ref.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        local_backward(ddp, x, y, rank, world_size)
        opt.step()
    assert_params_close(ddp.module, reference, **FP32_TOL)


# world size 2 (and 3) of the default bfloat16 path: test_default_path_bits.py
@pytest.mark.parametrize("world_size", [4])
def test_find_unused_parameters(world_size):
    torch_path_workers(_unused_parameters_worker, world_size)


def _subgroup_worker(rank, world_size):
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    model = make_model()
    # each pair of ranks trains on its own half of the batch: pair p covers rows [p*8, p*8+8)
    pair, local = rank // 2, rank % 2
    reference = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    ddp = DDP(model, process_group=mine, bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, comm_dtype=torch.float32)
    assert state.context.world_size == 2
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        x, y = make_data(step)
        xp, yp = local_slice(x, pair, 2), local_slice(y, pair, 2)
        opt_ref.zero_grad()
        nn.functional.mse_loss(reference(xp), yp).backward()
        opt_ref.step()
        opt.zero_grad()
        nn.functional.mse_loss(ddp(local_slice(xp, local, 2)), local_slice(yp, local, 2)).backward()
        opt.step()
    assert_params_close(ddp.module, reference, **FP32_TOL)


def test_subgroup_as_process_group():
    torch_path_workers(_subgroup_worker, 4)


def batches_of(rank):
    return 3 + 2 * rank  # every rank has two more batches than the one before


def _join_worker(rank, world_size):
    model = make_model()
    reference = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.002)
    ddp_triton.register(ddp, comm_dtype=torch.float32)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():
        for step in range(batches_of(rank)):
            x, y = make_data(step)
            opt.zero_grad()
            local_backward(ddp, x, y, rank, world_size)
            opt.step()
    # Reference: at each step the ranks that still have data contribute their gradients, the ranks that joined
    # contribute zeros, and the sum is divided by the full world size (DDP's divide_by_initial_world_size).
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(batches_of(world_size - 1)):
        x, y = make_data(step)
        total = [torch.zeros_like(p) for p in reference.parameters()]
        for r in range(world_size):
            if step < batches_of(r):
                reference.zero_grad()
                local_backward(reference, x, y, r, world_size)
                total = [t + p.grad for t, p in zip(total, reference.parameters())]
        for p, t in zip(reference.parameters(), total):
            p.grad = t / world_size
        opt_ref.step()
    assert_params_close(ddp.module, reference, **FP32_TOL)


@pytest.mark.parametrize("world_size", [2, 4])
def test_uneven_inputs_under_join(world_size):
    torch_path_workers(_join_worker, world_size)


# The bfloat16 layers compute in bfloat16 (8 significant bits, 2**-8 = 0.4% per rounding) through a few matmuls
# and activations: differences of a few roundings, up to ~2%, are that arithmetic, not the hook.
BF16_MODEL_TOL = dict(atol=0.02, rtol=0.02)


def _dtypes_worker(rank, world_size):
    # A bfloat16 model sent as bfloat16 (in place in DDP's buckets), then a model with float32 and bfloat16
    # parameters (DDP gives each dtype its own buckets), against the full-batch float32 gradient of the same weights.
    for make in (lambda: make_model(dtype=torch.bfloat16), TwoDtypes):
        model = make()
        reference = copy.deepcopy(model).float()
        x, y = make_data(0)
        nn.functional.mse_loss(reference(x), y).backward()
        ddp = DDP(model, gradient_as_bucket_view=True)
        state = ddp_triton.register(ddp)
        xs = local_slice(x, rank, world_size).to(next(model.parameters()).dtype)
        nn.functional.mse_loss(ddp(xs).float(), local_slice(y, rank, world_size)).backward()
        dtypes = {e.buffer.dtype for e in state.plans.values()}
        assert torch.bfloat16 in dtypes
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.float(), q.grad, **BF16_MODEL_TOL)


@pytest.mark.parametrize("world_size", [2, 4])
def test_bfloat16_model_and_mixed_dtypes(world_size):
    torch_path_workers(_dtypes_worker, world_size)


def _memory_worker(rank, world_size):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.002, gradient_as_bucket_view=True)
    state = ddp_triton.register(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    held, comms = None, None
    for step in range(22):  # steady state from step 10 on: DDP rebuilt its buckets, stale entries were dropped
        x, y = make_data(step % 7)
        opt.zero_grad()
        local_backward(ddp, x, y, rank, world_size)
        opt.step()
        if step == 10:  # past DDP's bucket rebuild and the pruning of the first buckets' entries
            held = state.held_bytes()
            comms = {k: e.wire_buffer for k, e in state.plans.items()}
    assert state.held_bytes() == held
    assert held == sum(p.numel() for p in model.parameters()) * 2  # one bfloat16 copy of each bucket
    assert state.plans.keys() == comms.keys()
    assert all(state.plans[k].wire_buffer is c for k, c in comms.items()), "communication buffers were reallocated"


def test_long_run_holds_constant_memory():
    torch_path_workers(_memory_worker, 2)


def _compiled_worker(rank, world_size):
    model = make_model()
    reference = train_reference(copy.deepcopy(model), steps=3)
    # default bucket caps: DDPOptimizer insists the first bucket is no larger than the others
    ddp = DDP(torch.compile(model, backend="aot_eager"))
    ddp_triton.register(ddp, comm_dtype=torch.float32)
    train_ddp(ddp, rank, world_size, steps=3)
    assert_params_close(model, reference, **FP32_TOL)
    # torch's own bf16 hook works on the same kind of model, and so does ours with None state: both train it to
    # the float32 result within bfloat16's resolution (two roundings of 2**-9 per step, over two steps)
    trained = []
    for hook in (torch_bf16_hook, ddp_triton.triton_hook):
        other = DDP(torch.compile(make_model(), backend="aot_eager"))
        other.register_comm_hook(None, hook)
        train_ddp(other, rank, world_size, steps=2)
        trained.append(other.module)
    fp32 = train_reference(make_model(), steps=2)
    for net in trained:
        assert_params_close(net, fp32, atol=1e-3, rtol=1e-2)


# compiling costs seconds a rank, and the bucket path it feeds does not depend on the world size
@pytest.mark.parametrize("world_size", [2])
def test_torch_compiled_module(world_size):
    torch_path_workers(_compiled_worker, world_size)


def _bad_input_worker(rank, world_size):
    with pytest.raises(ValueError, match="comm_dtype"):
        ddp_triton.CommState(comm_dtype=torch.float64)
    subgroup = dist.new_group([0])
    if rank == 1:
        with pytest.raises(ValueError, match="not a member"):
            ddp_triton.CommState(process_group=subgroup)
    with pytest.raises(TypeError, match="float64"):
        ddp_triton.register(DDP(make_model(dtype=torch.float64)))
    # float64 through register_comm_hook directly: a clear error at the first bucket, on every rank
    ddp = DDP(make_model(dtype=torch.float64))
    ddp.register_comm_hook(None, ddp_triton.triton_hook)
    x, y = make_data(0, torch.float64)
    with pytest.raises(Exception, match="float64"):
        nn.functional.mse_loss(ddp(x), y).backward()
    # sparse gradients
    emb = DDP(nn.Embedding(10, 4, sparse=True))
    emb.register_comm_hook(ddp_triton.CommState(profile=None), ddp_triton.triton_hook)
    with pytest.raises(Exception, match="sparse"):
        emb(torch.tensor([1, 2, 3])).sum().backward()
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ddp_triton.register(make_model())


def test_bad_input_fails_clearly_on_every_rank():
    torch_path_workers(_bad_input_worker, 2)


def test_average_factors_keep_the_product():
    for n in (1, 2, 3, 8, 1024):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            pre, post = average_factors(n, dtype)
            assert pre * post == pytest.approx(1 / n, rel=1e-12)
            if dtype != torch.float16:
                assert post == 1.0


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 64, 100, 1024, 4096, 65536])
def test_float16_split_is_a_power_of_two_within_the_stated_bound(n):
    pre, post = average_factors(n, torch.float16)
    assert math.frexp(pre)[0] == 0.5, f"pre {pre} is not a power of two"
    if n & (n - 1) == 0:  # a power-of-two world size: both factors exact
        assert math.frexp(post)[0] == 0.5 and pre * post * n == 1.0
    # The bound in docs/formats.md: a sum over N ranks grows at most sqrt(2N) times, a gradient shrinks at most sqrt(2N)
    # times before the wire (32x each at N = 1024).
    assert n * pre <= math.sqrt(2 * n) and 1 / pre <= math.sqrt(2 * n)
    if n == 1024:
        assert (pre, post) == (1 / 32, 1 / 32)


def test_comm_state_before_init_process_group_is_unbound():
    """Built before the group exists it keeps its settings and binds later (tests/dist/runtime/test_lazy_state.py)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    state = ddp_triton.CommState()
    assert not state.bound and state.comm_dtype == torch.bfloat16


def _fp16_worker(rank, world_size):
    model = make_model()
    reference = copy.deepcopy(model)
    x, y = make_data(0)
    nn.functional.mse_loss(reference(x), y).backward()
    ddp = DDP(model, bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, comm_dtype=torch.float16)
    assert state.context.wire_for(1)[1:] == average_factors(world_size, torch.float16)
    local_backward(ddp, x, y, rank, world_size)
    for p, q in zip(model.parameters(), reference.parameters()):
        # float16 keeps 11 significant bits: one rounding before the wire, one per addition in the sum and one
        # after, each at most 2**-11 relative, so 4 * 2**-11 ~ 2e-3; atol covers gradients near zero.
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("world_size", [2, 4])
def test_float16_on_the_wire(world_size):
    torch_path_workers(_fp16_worker, world_size)


def _fp16_exact_worker(rank, world_size):
    # A gradient of 0.25 on every rank comes back as exactly 0.25 (the 1/sqrt(N) split gave 0.2499733 at N = 2).
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    ddp = DDP(model)
    ddp_triton.register(ddp, comm_dtype=torch.float16)
    ddp(torch.full((1, 4), 0.25)).sum().backward()
    assert torch.equal(model.weight.grad, torch.full((1, 4), 0.25)), model.weight.grad
    # Random gradients: bit for bit what torch's fp16_compress_hook gives, at a power-of-two world size.
    ours, theirs = make_model(), make_model()
    x, y = make_data(0)
    ddp_ours = DDP(ours, bucket_cap_mb=0.002)
    ddp_triton.register(ddp_ours, comm_dtype=torch.float16)
    ddp_theirs = DDP(theirs, bucket_cap_mb=0.002)
    ddp_theirs.register_comm_hook(None, torch_fp16_hook)
    local_backward(ddp_ours, x, y, rank, world_size)
    local_backward(ddp_theirs, x, y, rank, world_size)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("world_size", [2, 4])
def test_float16_split_is_exact_at_power_of_two_world_sizes(world_size):
    torch_path_workers(_fp16_exact_worker, world_size)


def _process_group_state_worker(rank, world_size):
    model = make_model()
    x, y = make_data(0)
    # Each rank's own gradient of its slice, g_r; the exact average is sum(g_r) / N.
    local = []
    for r in range(world_size):
        replica = copy.deepcopy(model)
        local_backward(replica, x, y, r, world_size)
        local.append([p.grad for p in replica.parameters()])
    ddp = DDP(model, bucket_cap_mb=0.002)
    ddp.register_comm_hook(dist.group.WORLD, ddp_triton.triton_hook)  # a process group as state, as torch allows
    local_backward(ddp, x, y, rank, world_size)
    unit = 2.0**-8  # twice bfloat16's unit roundoff
    for i, p in enumerate(model.parameters()):
        terms = [g[i] / world_size for g in local]
        exact = sum(terms)
        # g_r / N rounded once to bfloat16 (<= u |term|), then N - 1 bfloat16 additions (each <= u |partial sum|
        # <= u sum |terms|): |error| <= N u sum |terms|, plus float32 noise.
        bound = world_size * unit * sum(t.abs() for t in terms) + 1e-7
        assert bool(((p.grad - exact).abs() <= bound).all()), f"parameter {i} is off by more than bfloat16 allows"


def test_process_group_as_state_like_torch_hooks():
    torch_path_workers(_process_group_state_worker, 2)


def _shared_state_worker(rank, world_size):
    """Two models (a GAN's two halves, say) registered with None share the default state: neither evicts the other."""
    from ddp_triton.runtime.hook import default_state

    models = [DDP(make_model(seed=s), bucket_cap_mb=0.002) for s in (0, 1)]
    for m in models:
        m.register_comm_hook(None, ddp_triton.triton_hook)
    comms = None
    for step in range(12):
        x, y = make_data(step)
        for m in models:
            m.zero_grad()
            local_backward(m, x, y, rank, world_size)
        if step == 8:
            comms = {k: e.wire_buffer for k, e in default_state().plans.items()}
    assert len(comms) >= 4, "both models' buckets are in the shared state"
    assert {k: e.wire_buffer for k, e in default_state().plans.items()} == comms, "buffers were rebound"


def test_models_sharing_the_default_state_keep_their_buffers():
    torch_path_workers(_shared_state_worker, 2)
