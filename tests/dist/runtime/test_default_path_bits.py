"""The default path (bfloat16 on the wire, one all-reduce) pinned bit for bit through DDP's modes.

Tier: gloo multi-process on CPU (world sizes 2 and 3, one spawned job each), on the kernels' torch path. At every
step each rank also computes every rank's local gradient on a copy of the model and the average the format
defines (``bf16_all_reduce_candidates``): each rank's gradient times 1/N rounded once to bfloat16, summed in
bfloat16 with one rounding per addition in the backend's order, widened back to float32. With three ranks the
backend may add in any of three orders, so each averaged gradient element must equal one of their results; with
two there is one. A hook that sent float32, rounded twice before the wire, or skipped a rank would miss them.

Modes: several buckets across DDP's rebuild, gradients as bucket views, static_graph, no_sync accumulation,
find_unused_parameters (unused on some ranks, on none, on all), join() with uneven inputs, a subgroup, and a
torch.compile'd module.
"""

import copy
from itertools import combinations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_helpers import Branchy, local_backward, local_grads, local_slice, make_data, make_model, torch_path_workers

BF16 = torch.bfloat16


def bf16_all_reduce_candidates(per_rank):
    """Every result the bfloat16 all-reduce of ``per_rank`` (each rank's float32 gradient of one tensor) may give,
    stacked: the pack rounds ``g * (1/N)`` once; a sum of N terms in bfloat16 rounds after each addition, in an order
    the backend picks (for N <= 3 every order is one of these)."""
    n = len(per_rank)
    packed = [(g.float() * (1.0 / n)).to(BF16) for g in per_rank]

    def add(a, b):
        return (a.float() + b.float()).to(BF16)

    if n == 1:
        return packed[0].float()[None]
    if n == 2:
        return add(*packed).float()[None]
    if n == 3:
        results = []
        for first in combinations(range(3), 2):
            last = ({0, 1, 2} - set(first)).pop()
            results.append(add(add(packed[first[0]], packed[first[1]]), packed[last]).float())
        return torch.stack(results)
    raise ValueError("orders are enumerated for up to 3 ranks")


def assert_one_of(got, candidates, what):
    bits = got.detach().float().contiguous().view(torch.int32)
    allowed = candidates.contiguous().view(torch.int32)
    matches = (allowed == bits[None]).any(dim=0)
    assert bool(matches.all()), (f"{what}: {int((~matches).sum())} of {got.numel()} elements are none of the "
                                 f"format's results, e.g. {got.flatten()[~matches.flatten()][:3].tolist()}")


def check_step(ddp, module, batches_of_rank, world_size, what, skip=()):
    """Each gradient of ``ddp`` is one of the format's averages of every rank's local gradient (``batches_of_rank(r)``:
    rank r's batches this step, [] for a rank that contributes zeros)."""
    per_rank = [local_grads(module, batches_of_rank(r), r, world_size) for r in range(world_size)]
    for i, (name, p) in enumerate(ddp.module.named_parameters()):
        if name in skip:
            continue
        assert p.grad is not None, f"{what}: {name} has no gradient"
        assert_one_of(p.grad, bf16_all_reduce_candidates([g[i] for g in per_rank]), f"{what}, {name}")


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def _plain_modes(rank, world_size):
    for kwargs in (dict(bucket_cap_mb=0.002), dict(bucket_cap_mb=0.002, gradient_as_bucket_view=True),
                   dict(bucket_cap_mb=0.002, static_graph=True)):
        ddp = DDP(make_model(), **kwargs)
        state = ddp_triton.register(ddp)  # the default: bfloat16, one all-reduce
        assert state.wire.name == "bf16"
        opt = sgd(ddp.parameters())
        for s in range(3):  # step 0 in the constructor's buckets, then DDP's rebuilt ones
            batch = make_data(s)
            opt.zero_grad()
            local_backward(ddp, *batch, rank, world_size)
            check_step(ddp, ddp.module, lambda r: [batch], world_size, f"{kwargs} step {s}")
            opt.step()
        assert len(state.plans) > 1


def _no_sync(rank, world_size):
    ddp = DDP(make_model(), bucket_cap_mb=0.002)
    ddp_triton.register(ddp)
    opt = sgd(ddp.parameters())
    for s in range(2):
        micro = [make_data(10 * s + m) for m in range(2)]
        opt.zero_grad()
        with ddp.no_sync():
            local_backward(ddp, *micro[0], rank, world_size)
        local_backward(ddp, *micro[1], rank, world_size)
        check_step(ddp, ddp.module, lambda r: micro, world_size, f"no_sync step {s}")
        opt.step()


def _unused_parameters(rank, world_size):
    model = Branchy()
    ddp = DDP(model, find_unused_parameters=True)
    ddp_triton.register(ddp)
    opt = sgd(ddp.parameters())
    for s, users in enumerate(({0}, set(), set(range(world_size)))):  # the branch used on rank 0, none, all
        model.use_branch = rank in users
        batch = make_data(s)
        opt.zero_grad()
        local_backward(ddp, *batch, rank, world_size)

        def on(r):
            reference = copy.deepcopy(model)
            reference.use_branch = r in users
            return reference

        per_rank = [local_grads(on(r), [batch], r, world_size) for r in range(world_size)]
        for i, (name, p) in enumerate(model.named_parameters()):
            if name.startswith("branch") and not users:
                assert p.grad is None, f"{name}: unused on every rank, DDP leaves it unset"
                continue
            assert_one_of(p.grad, bf16_all_reduce_candidates([g[i] for g in per_rank]), f"unused step {s}, {name}")
        opt.step()


def batches(rank):
    return 2 + rank  # uneven inputs: rank r has 2 + r batches


def _join(rank, world_size):
    ddp = DDP(make_model(), bucket_cap_mb=0.002)
    ddp_triton.register(ddp)
    opt = sgd(ddp.parameters())
    with ddp.join():
        for s in range(batches(rank)):
            batch = make_data(s)
            opt.zero_grad()
            local_backward(ddp, *batch, rank, world_size)
            # the ranks that have joined send zeros; the sum is divided by the whole world size
            check_step(ddp, ddp.module, lambda r: [batch] if s < batches(r) else [], world_size, f"join step {s}")
            opt.step()


def _subgroup(rank, world_size):
    # ranks 0 and 1 average over their pair; rank 2 over itself alone (world size 1: rounded once, no sum)
    groups = [dist.new_group([0, 1]), dist.new_group([2])]
    mine, members = (groups[0], 2) if rank < 2 else (groups[1], 1)
    local = rank if rank < 2 else 0
    ddp = DDP(make_model(), process_group=mine, bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp)
    assert state.context.world_size == members
    opt = sgd(ddp.parameters())
    for s in range(2):
        batch = make_data(s + 20 * (rank // 2))
        opt.zero_grad()
        local_backward(ddp, *batch, local, members)
        check_step(ddp, ddp.module, lambda r: [batch], members, f"subgroup step {s}")
        opt.step()


def _compiled(rank, world_size):
    model = make_model()
    ddp = DDP(torch.compile(model, backend="aot_eager"))  # default buckets: DDPOptimizer's first-bucket rule
    ddp_triton.register(ddp)
    opt = sgd(ddp.parameters())
    for s in range(2):
        batch = make_data(s)
        opt.zero_grad()
        local_backward(ddp, *batch, rank, world_size)
        check_step(ddp, model, lambda r: [batch], world_size, f"compiled step {s}")
        opt.step()


def _modes_worker(rank, world_size):
    for case in (_plain_modes, _no_sync, _unused_parameters, _join):
        case(rank, world_size)
    if world_size == 3:
        _subgroup(rank, world_size)
    else:  # compiling costs seconds a rank; the bucket path it feeds does not depend on the world size
        _compiled(rank, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_default_bf16_path_bit_exact_through_ddp_modes(world_size):
    torch_path_workers(_modes_worker, world_size, timeout=240)


def test_the_reference_tells_float32_and_double_rounding_apart():
    """What the check above would catch: float32 on the wire, or a value rounded to bfloat16 twice."""
    gen = torch.Generator().manual_seed(0)
    per_rank = [torch.randn(4096, generator=gen) for _ in range(3)]
    candidates = bf16_all_reduce_candidates(per_rank)
    float32_mean = sum(g * (1 / 3) for g in per_rank)
    with pytest.raises(AssertionError, match="none of the format's results"):
        assert_one_of(float32_mean, candidates, "float32 on the wire")
    cast_then_divide = [(g.to(BF16) / 3).to(BF16).float() for g in per_rank]  # torch's bf16_compress_hook's order
    twice = ((cast_then_divide[0] + cast_then_divide[1]).to(BF16).float() + cast_then_divide[2]).to(BF16).float()
    with pytest.raises(AssertionError, match="none of the format's results"):
        assert_one_of(twice, candidates, "rounded before the division")
    assert_one_of(candidates[1], candidates, "one of them")
    assert local_slice(torch.arange(6), 1, 3).tolist() == [2, 3]
