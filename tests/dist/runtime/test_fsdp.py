"""Our wire formats as FSDP2's reduce-scatter (``ddp_triton.fsdp.register``).

Tier: gloo multi-process on CPU (2 and 3 ranks, spawned here; FSDP2 on a CPU device mesh), the kernels' torch CPU
path. Each rank trains the same small model, sharded per layer with ``fully_shard``, on its slice of each batch. The
reference is written from the format's definition: every rank's local gradient of each parameter (from an unsharded
copy on the same weights), padded on dim 0 to a multiple of N as FSDP pads it, times 1/N rounded once to bf16,
summed in float32 in rank order; rank r's sharded gradient must be its rows of that, bit for bit.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import ddp_triton.fsdp
import ddp_helpers
from ddp_helpers import local_backward, torch_path_workers
from wire_reference import _left_over, fp8_average, kept, quantize_dequantize
from ddp_triton.formats import WireFormat

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp_api, "FSDPModule") or not hasattr(fsdp_api.FSDPModule, "set_custom_reduce_scatter"):
    pytest.skip("this torch's FSDP2 takes no custom reduce-scatter", allow_module_level=True)

BATCH = 12


def make_model():
    """Rows of 33 and 5, not multiples of N: FSDP pads them on dim 0."""
    return ddp_helpers.make_model(widths=(8, 33, 5, 4))


def shard(model, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def data(step):
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, 8, generator=gen), torch.randn(BATCH, 4, generator=gen)


def per_rank_grads(plain, x, y, world_size):
    """Every rank's local gradients, in rank order."""
    return [ddp_helpers.local_grads(plain, [(x, y)], r, world_size) for r in range(world_size)]


def expected_shard(grads, rank, world_size, divide_by=None):
    """Rank ``rank``'s rows of sum_r bf16(g_r / N) (or / ``divide_by``), in float32, FSDP's dim-0 padding
    included."""
    divide_by = world_size if divide_by is None else divide_by
    rows = -(-grads[0].shape[0] // world_size)
    total = None
    for g in grads:
        padded = torch.zeros((rows * world_size, *grads[0].shape[1:]))
        padded[: g.shape[0]] = g
        value = (padded * (1.0 / divide_by)).to(torch.bfloat16).float()
        total = value if total is None else total + value  # in rank order from the first rank's value
    mine = total[rank * rows:(rank + 1) * rows]
    return mine[: max(0, min(rows, grads[0].shape[0] - rank * rows))]


def _bits_worker(rank, world_size, divide_by=None):
    plain = make_model()
    model = shard(make_model(), world_size)
    if divide_by is not None:  # FSDP then passes PREMUL_SUM, whose factor is the module's
        for module in model.modules():
            if isinstance(module, fsdp_api.FSDPModule):
                module.set_gradient_divide_factor(divide_by)
    state = ddp_triton.fsdp.register(model)  # bfloat16 on the wire, float32 sums
    assert state.wire.name == "bf16+fp32sum" and len(state.comms) == 4
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    for step in range(3):
        x, y = data(step)
        per_rank = per_rank_grads(plain, x, y, world_size)
        opt.zero_grad()
        local_backward(model, x, y, rank, world_size)
        for i, p in enumerate(model.parameters()):
            got = p.grad.to_local()
            want = expected_shard([g[i] for g in per_rank], rank, world_size, divide_by)
            assert torch.equal(got.contiguous().view(torch.int32), want.contiguous().view(torch.int32)), \
                f"parameter {i} at step {step}"
        # The plain copy takes the same step with the reference's whole average, so both stay on one path.
        for i, q in enumerate(plain.parameters()):
            full = torch.cat([expected_shard([g[i] for g in per_rank], r, world_size, divide_by)
                              for r in range(world_size)])
            q.grad = full.view_as(q)
        opt.step()
        plain_opt.step()
    assert state.calls == 3 * 3  # one reduce-scatter per FSDP group that holds parameters, per backward
    # Each group's pack and sum of slices were prepared at its first reduce-scatter and run on new buffers since.
    assert [c.kernels.prepared for c in state.comms if c.calls] == [2, 2, 2]


@pytest.mark.parametrize("world_size, divide_by", [(2, None), (3, None), (2, 8.0)])
def test_bf16_with_float32_sums_matches_the_reference(world_size, divide_by):
    torch_path_workers(_bits_worker, world_size, divide_by)


def _other_formats_worker(rank, world_size):
    """At 2 ranks: fp16 with float32 sums (scaled by 1 before the wire, the power of two nearest 1/sqrt(2), and by
    1/2 after, in float32), plain bf16 (the reduce-scatter sums in bf16: one addition, one rounding), and fp16 where
    FSDP sums and divides by itself (nothing scaled twice)."""
    cases = ((dict(comm_dtype=torch.float16), torch.float16, True, 1.0, 0.5, False),
             (dict(accumulate_dtype=None), torch.bfloat16, False, 0.5, 1.0, False),
             # FSDP told to sum: it passes SUM and divides the float32 result by N itself, after ours
             (dict(comm_dtype=torch.float16), torch.float16, True, 1.0, 0.5, True))
    for options, sent, fp32_sum, pre, post, force_sum in cases:
        plain = make_model()
        model = shard(make_model(), world_size)
        if force_sum:
            for module in model.modules():
                if isinstance(module, fsdp_api.FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        ddp_triton.fsdp.register(model, **options)
        x, y = data(0)
        per_rank = per_rank_grads(plain, x, y, world_size)
        local_backward(model, x, y, rank, world_size)
        for i, p in enumerate(model.parameters()):
            a, b = ((g[i] * pre).to(sent) for g in per_rank)
            total = a.float() + b.float() if fp32_sum else (a.float() + b.float()).to(sent).float()
            total = total * post if post != 1.0 else total
            rows = -(-total.shape[0] // world_size)
            want = total[rank * rows:(rank + 1) * rows]
            assert torch.equal(p.grad.to_local().contiguous().view(torch.int32),
                               want.contiguous().view(torch.int32)), (options, i)


def test_fp16_with_float32_sums_and_plain_bf16():
    torch_path_workers(_other_formats_worker, 2)


def _float32_worker(rank, world_size):
    ours = shard(make_model(), world_size)
    theirs = shard(make_model(), world_size)
    ddp_triton.fsdp.register(ours, comm_dtype=torch.float32, accumulate_dtype=None)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    for step in range(4):
        x, y = data(step)
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            local_backward(model, x, y, rank, world_size)
            opt.step()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p.to_local().view(torch.int32), q.to_local().view(torch.int32)), name


def test_float32_on_the_wire_is_fsdp2_without_us():
    torch_path_workers(_float32_worker, 2)


def _options_worker(rank, world_size):
    model = shard(make_model(), world_size)
    with pytest.raises(ValueError, match="error_feedback applies to FP8"):
        ddp_triton.fsdp.register(model, error_feedback=True)
    with pytest.raises(ValueError, match="no FSDP module"):
        ddp_triton.fsdp.register(make_model())
    with pytest.raises(ValueError, match="comm_dtype='two-level fp4e2m1\\+ef': FSDP's reduce-scatter and replica hop "
                                         "have no two-level exchange"):
        ddp_triton.fsdp.register(model, comm_dtype="two-level fp4e2m1+ef")
    with pytest.raises(TypeError, match="nn.Module"):
        ddp_triton.fsdp.register("model")
    comm = ddp_triton.fsdp.register(model).comms[0]
    with pytest.raises(ValueError, match="async_op=False"):
        comm(torch.empty(2), torch.empty(2 * world_size), dist.group.WORLD, dist.ReduceOp.AVG, async_op=True)
    dist.barrier()


def test_options_that_cannot_be_are_refused_by_name():
    torch_path_workers(_options_worker, 2)


def test_a_torch_without_custom_reduce_scatter_is_named(monkeypatch):
    from ddp_triton.runtime import fsdp

    monkeypatch.setattr(fsdp, "FSDPModule", None)
    with pytest.raises(RuntimeError, match=f"needs torch >= {fsdp.MIN_TORCH_FOR_FSDP}"):
        fsdp.register(nn.Linear(2, 2))


def _hsdp_backward(rank, world_size, replicas):
    """A model sharded over each replica's ranks, our bf16 + float32 sums between the ``replicas`` (the shard hop
    FSDP2's float32), one backward. Returns the mesh, the model, the state, every rank's local gradients (from an
    unsharded copy) and how many all-to-alls this rank issued."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))
    plain, model = make_model(), make_model()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = ddp_triton.fsdp.register(model, comm_dtype=torch.float32, accumulate_dtype=None,
                                     replicate_group=mesh.get_group("replicate"))
    assert state.replica_wire.name == "bf16+fp32sum"
    x, y = data(0)
    per_rank = per_rank_grads(plain, x, y, world_size)
    real_all_to_all, all_to_alls = dist.all_to_all_single, []
    dist.all_to_all_single = lambda *a, **k: all_to_alls.append(1) or real_all_to_all(*a, **k)
    try:
        local_backward(model, x, y, rank, world_size)
    finally:
        dist.all_to_all_single = real_all_to_all
    assert sorted(h.calls for h in state.replica_hooks) == [0, 1, 1, 1]  # the root holds no parameters of its own
    return mesh, model, per_rank, len(all_to_alls)


def _hsdp_worker(rank, world_size):
    """2 replicas x 2 shards: FSDP2's float32 reduce-scatter inside each replica, then bf16 with float32 sums
    between the replicas. Rank (i, j) = 2i + j."""
    mesh, model, per_rank, all_to_alls = _hsdp_backward(rank, world_size, 2)
    assert all_to_alls == 0  # two replicas: the float32 sum of two is one bf16 all-reduce, the same bits
    replica, shard_index = divmod(rank, 2)
    for i, p in enumerate(model.parameters()):
        in_replica = [(per_rank[2 * k][i] + per_rank[2 * k + 1][i]) / 2 for k in range(2)]  # the shard hop, float32
        sent = [(s * 0.5).to(torch.bfloat16).float() for s in in_replica]
        total = (sent[0] + sent[1]).to(torch.bfloat16).float()
        rows = -(-total.shape[0] // 2)
        want = total[shard_index * rows:(shard_index + 1) * rows]
        assert torch.equal(p.grad.to_local().contiguous().view(torch.int32), want.contiguous().view(torch.int32)), i
    # A model sharded on the whole 2-D mesh is native HSDP: FSDP all-reduces the replicas itself.
    from torch.distributed.fsdp import fully_shard

    native = make_model()
    fully_shard(native, mesh=mesh)
    with pytest.raises(ValueError, match="native HSDP"):
        ddp_triton.fsdp.register(native, replicate_group=mesh.get_group("replicate"))
    dist.barrier()


def _three_replicas_worker(rank, world_size):
    """3 replicas of one rank each: the replica hop in bf16 with float32 sums over three, by all-to-all and
    all-gather (over two it is one all-reduce): every rank's gradient / 3 rounded to bf16, summed in float32 in rank
    order, rounded once."""
    _, model, per_rank, all_to_alls = _hsdp_backward(rank, world_size, 3)
    assert all_to_alls == 3  # one per FSDP group that holds parameters
    for i, p in enumerate(model.parameters()):
        sent = [(g[i] * (1.0 / 3)).to(torch.bfloat16).float() for g in per_rank]
        want = (sent[0] + sent[1] + sent[2]).to(torch.bfloat16).float()
        assert torch.equal(p.grad.to_local().contiguous().view(torch.int32), want.contiguous().view(torch.int32)), i


def test_hsdp_over_three_replicas_sums_in_float32_by_all_to_all():
    torch_path_workers(_three_replicas_worker, 3)


def test_hsdp_keeps_float32_in_the_replica_and_sends_bf16_between_replicas():
    torch_path_workers(_hsdp_worker, 4)


def resume_needs_the_residuals(rank, world_size, tmp, model, state, opt, fresh, steps):
    """Save ``state``'s residuals and the weights, then train ``steps`` unbroken; from the saved point, a model and
    state from ``fresh()`` trains the same steps with the residuals loaded (the same bits) and without them (not the
    same). Returns what was saved and its file."""
    saved = state.state_dict()
    weights = {name: p.to_local().clone() for name, p in model.named_parameters()}

    def train(model, opt):
        for step in steps:
            x, y = data(step)
            opt.zero_grad()
            local_backward(model, x, y, rank, world_size)
            opt.step()

    train(model, opt)
    unbroken = [p.to_local().clone() for p in model.parameters()]
    path = f"{tmp}/rank{rank}.pt"
    torch.save(saved, path)
    for load in (True, False):
        model, state, opt = fresh()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.to_local().copy_(weights[name])
        if load:
            state.load_state_dict(torch.load(path, weights_only=True))
        train(model, opt)
        same = all(torch.equal(p.to_local(), q) for p, q in zip(model.parameters(), unbroken))
        assert same == load, load  # the residuals make the difference
    return saved, path


def _fp8_expected(per_rank, firsts, world_size, fmt):
    """Every rank's rows of each parameter after FP8 with error feedback, from the definition: each rank's padded
    gradient / N plus its residual, cut into the N chunks of dim-0 rows, each chunk quantized in blocks of 128 from
    its start; rank k adds the ranks' dequantized chunk k in float32 in rank order. ``firsts`` (per rank, per
    parameter, padded shape) are updated as error feedback does. Returns [rank][parameter]."""
    out = [[] for _ in range(world_size)]
    for i in range(len(per_rank[0])):
        shape = per_rank[0][i].shape
        rows = -(-shape[0] // world_size)
        total = None
        for r in range(world_size):
            padded = torch.zeros((rows * world_size, *shape[1:]))
            padded[: shape[0]] = per_rank[r][i]
            value = padded * (1.0 / world_size) + firsts[r][i]
            sent = torch.cat([quantize_dequantize(value[k * rows:(k + 1) * rows].reshape(-1).clone(), fmt)
                              for k in range(world_size)]).view_as(value)
            firsts[r][i] = kept(torch.cat([_left_over(value[k * rows:(k + 1) * rows].reshape(-1).clone(),
                                                      sent[k * rows:(k + 1) * rows].reshape(-1))
                                           for k in range(world_size)]).view_as(value))
            total = sent.clone() if total is None else total + sent
        for k in range(world_size):
            out[k].append(total[k * rows:k * rows + max(0, min(rows, shape[0] - k * rows))])
    return out


def _fp8_worker(rank, world_size, tmp, name="fp8e4m3+ef"):
    """A block-scaled format with error feedback (``name``, given to register as comm_dtype), against the reference."""
    fmt = WireFormat.parse(name).comm_dtype

    def fresh():
        model = shard(make_model(), world_size)
        return model, ddp_triton.fsdp.register(model, comm_dtype=name), torch.optim.SGD(model.parameters(), lr=0.05)

    plain = make_model()
    model, state, opt = fresh()
    assert state.wire.name == name
    firsts = [[torch.zeros((-(-p.shape[0] // world_size) * world_size, *p.shape[1:])) for p in plain.parameters()]
              for _ in range(world_size)]
    for step in range(3):  # bits against the definition, the residuals carried from step to step
        x, y = data(step)
        per_rank = per_rank_grads(plain, x, y, world_size)
        opt.zero_grad()
        local_backward(model, x, y, rank, world_size)
        expected = _fp8_expected(per_rank, firsts, world_size, fmt)
        for i, p in enumerate(model.parameters()):
            want = expected[rank][i]
            assert torch.equal(p.grad.to_local().contiguous().view(torch.int32), want.contiguous().view(torch.int32)), \
                f"parameter {i} at step {step}"
        with torch.no_grad():
            for i, q in enumerate(plain.parameters()):
                q -= 0.05 * torch.cat([expected[k][i] for k in range(world_size)]).view_as(q)
        opt.step()
        if step == 0:
            first_layouts = [(c.layout, c.row_layout) for c in state.comms if c.calls]
    # Each group's block layouts were built at its first reduce-scatter and reused since.
    assert len(first_layouts) == 3 and all(a is not None for pair in first_layouts for a in pair)
    assert all(c.layout is a and c.row_layout is b
               for c, (a, b) in zip([c for c in state.comms if c.calls], first_layouts))
    assert [c.kernels.prepared for c in state.comms if c.calls] == [2, 2, 2]  # quantize, sum of blocks: once
    # Resume: three more steps unbroken, against a save after these three and a load into a fresh model and state.
    saved, path = resume_needs_the_residuals(rank, world_size, tmp, model, state, opt, fresh, range(3, 6))
    assert saved["wire_format"] == name and len(saved["residuals"]) == 6
    assert all(t.abs().sum() > 0 for t in saved["residuals"].values())
    state = fresh()[1]
    bad = dict(torch.load(path, weights_only=True), rank=world_size)
    with pytest.raises(ValueError, match="rank"):
        state.load_state_dict(bad)
    assert all(t.dtype == torch.bfloat16 for t in saved["residuals"].values())
    with pytest.raises(ValueError, match=r"earlier ddp-triton \(format 1, float32 residuals\)"):
        state.load_state_dict(dict(saved, version=1))
    with pytest.raises(ValueError, match="is not a torch.bfloat16 tensor"):
        state.load_state_dict(dict(saved, residuals={n: t.float() for n, t in saved["residuals"].items()}))


def test_a_group_s_block_layout_is_reused_while_its_chunks_and_ranks_stay():
    from ddp_triton.runtime.fsdp import cached_layout

    first = cached_layout((300, 40), 2, None)
    assert cached_layout((300, 40), 2, first) is first
    for sizes, n in (((300, 41), 2), ((300, 40), 3), ((40, 300), 2)):
        other = cached_layout(sizes, n, first)
        assert other is not first and other.sizes == sizes and other.n_shards == n
        assert torch.equal(other.table, ddp_triton.kernels.block_layout(sizes, n).table)


def test_a_group_prepares_each_kind_of_call_once_and_runs_it_on_each_calls_buffers():
    from ddp_triton.runtime.prepared_calls import KINDS, SHAPES_PER_KIND, PreparedCalls

    group, prepared_for = PreparedCalls(), []

    def prepare(tensors, out):
        prepared_for.append((tensors[0].numel(), out.dtype))
        return ddp_triton.kernels.pack.prepare(tensors, out, 0.5)

    def run(n, dtype=torch.bfloat16, what=("pack", 0.5)):
        src, out = torch.randn(n), torch.empty(n, dtype=dtype)
        group.run(what, prepare, [src], out)
        assert torch.equal(out, (src * 0.5).to(dtype))

    for n in (100, 100, 64, 100, 64):
        run(n)
    assert [n for n, _ in prepared_for] == [100, 64] and group.prepared == 2
    run(100, torch.float32)  # another dtype: prepared for it
    assert group.prepared == 3
    # Shapes that keep changing: a kind keeps its most recently used ones.
    for n in range(1, SHAPES_PER_KIND + 1):
        run(n)
    assert group.prepared == 3 + SHAPES_PER_KIND
    run(SHAPES_PER_KIND)  # recent: kept
    run(100)  # pushed out by the four since: prepared again
    assert group.prepared == 4 + SHAPES_PER_KIND
    # Kinds that keep changing: the least recently used kind goes.
    for k in range(KINDS):
        run(8, what=("pack", 0.5, k))
    run(8, what=("pack", 0.5, KINDS - 1))
    assert group.prepared == 4 + SHAPES_PER_KIND + KINDS
    run(100)  # its kind was pushed out
    assert group.prepared == 5 + SHAPES_PER_KIND + KINDS


def test_an_exchange_through_prepared_calls_takes_no_statistics():
    from ddp_triton.runtime.wire_exchanges import block_fp8_exchange, float32_sum_exchange
    from ddp_triton.runtime.prepared_calls import PreparedCalls
    from ddp_triton.formats import WireFormat

    buffer, stats, prepared = torch.randn(300), torch.zeros(2), PreparedCalls()
    with pytest.raises(ValueError, match="no statistics"):
        float32_sum_exchange(buffer, WireFormat.from_options(torch.bfloat16, torch.float32, None), None, 2, 0.5, 1.0,
                             stats, prepared=prepared)
    with pytest.raises(ValueError, match="no statistics"):
        block_fp8_exchange(buffer, WireFormat.from_options(torch.float8_e4m3fn, None, None),
                           ddp_triton.kernels.block_layout([300], 2), None, 2, 0.5, None, stats, prepared=prepared)
    assert prepared.prepared == 0


@pytest.mark.parametrize("world_size, name", [(2, "fp8e4m3+ef"), (3, "fp8e4m3+ef"), (2, "fp4e2m1+ef")])
def test_block_scaled_with_error_feedback_matches_the_reference_and_resumes(world_size, name, tmp_path):
    torch_path_workers(_fp8_worker, world_size, str(tmp_path), name)


def _fp8_interpreter_worker(rank, world_size, tmp):
    from ddp_triton.kernels import uses_triton

    assert uses_triton(torch.device("cpu")), "this worker should run the Triton kernels in the interpreter"
    _fp8_worker(rank, world_size, tmp)


def test_fp8_through_the_triton_kernels_matches_the_reference_and_resumes(tmp_path):
    """The same bits with the passes in the Triton kernels (the interpreter here; a GPU's path) as on the torch
    path: quantize with the residual, then the ranks' rows summed in float32 in one pass (``sum_blocks``)."""
    from dist_utils import run_workers
    from interpreter import interpreter_problem

    from ddp_triton.runtime.algo_groups import scoped_env

    if interpreter_problem() is not None:
        pytest.skip(interpreter_problem())
    with scoped_env({"TRITON_INTERPRET": "1"}):
        run_workers(_fp8_interpreter_worker, 3, str(tmp_path), timeout=240)  # 3 ranks: two adds per element


def _hsdp_fp8_worker(rank, world_size, tmp, name="fp8e4m3+ef"):
    """2 replicas x 2 shards, FP8 with error feedback between the replicas: each shard's chunks averaged over the
    replicas as DDP's flat FP8 exchange averages a bucket (both roundings fed back), over three steps; then a resume
    bit-identical only with the residuals of both hops."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fmt = WireFormat.parse(name).comm_dtype
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def fresh():
        model = make_model()
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        state = ddp_triton.fsdp.register(model, comm_dtype=torch.float32, accumulate_dtype=None,
                                         replicate_group=mesh.get_group("replicate"), replicate_comm_dtype=name)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05)

    plain = make_model()
    model, state, opt = fresh()
    assert state.replica_wire.name == name
    replica, shard_index = divmod(rank, 2)
    shapes = [p.shape for p in plain.parameters()]
    rows = [-(-s[0] // 2) for s in shapes]

    def chunk(t, i, j):
        padded = torch.zeros((rows[i] * 2, *shapes[i][1:]))
        padded[: shapes[i][0]] = t
        return padded[j * rows[i]:(j + 1) * rows[i]].reshape(-1).clone()

    first = {j: [[torch.zeros(rows[i] * int(torch.tensor(shapes[i][1:]).prod())) for i in range(len(shapes))]
                 for _ in range(2)] for j in range(2)}
    second = {j: [torch.zeros_like(first[j][0][i]) for i in range(len(shapes))] for j in range(2)}
    for step in range(3):
        x, y = data(step)
        per_rank = per_rank_grads(plain, x, y, world_size)
        opt.zero_grad()
        local_backward(model, x, y, rank, world_size)
        averaged = {}
        for j in range(2):  # each shard's replica exchange
            values = [[chunk((per_rank[2 * k][i] + per_rank[2 * k + 1][i]) / 2, i, j) for i in range(len(shapes))]
                      for k in range(2)]
            averaged[j] = fp8_average(values, fmt, first[j], second[j])
        for i, p in enumerate(model.parameters()):
            got = p.grad.to_local().contiguous().reshape(-1)
            want = averaged[shard_index][i][: got.numel()]
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"parameter {i} at step {step}"
        with torch.no_grad():
            for i, q in enumerate(plain.parameters()):
                whole = torch.cat([averaged[j][i] for j in range(2)])[: q.numel()]
                q -= 0.05 * whole.view_as(q)
        opt.step()
        if step == 0:
            first_layouts = [h.layout for h in state.replica_hooks if h.calls]
    assert len(first_layouts) == 3
    assert all(h.layout is a and a is not None
               for h, a in zip([h for h in state.replica_hooks if h.calls], first_layouts))
    # quantize and the float32 sum of the two replicas' rows into the float32 shard (one all-gather between them, no
    # requantization) prepared once per group; the shard hop is FSDP2's own float32 reduce-scatter
    assert [h.kernels.prepared for h in state.replica_hooks if h.calls] == [2, 2, 2]
    assert all(c.kernels.prepared == 0 for c in state.comms)
    saved, _ = resume_needs_the_residuals(rank, world_size, tmp, model, state, opt, fresh, range(3, 5))
    assert saved["replica_wire_format"] == name and sorted(saved["replica_residuals"]) == ["0", "2", "4"]


@pytest.mark.parametrize("name", ["fp8e4m3+ef", "fp4e2m1+ef"])
def test_hsdp_block_scaled_between_replicas_matches_the_reference_and_resumes(name, tmp_path):
    torch_path_workers(_hsdp_fp8_worker, 4, str(tmp_path), name)


def _fp16_sum_worker(rank, world_size):
    """4 ranks, fp16 with float32 sums, FSDP told to sum (it divides the float32 result by N itself): the gradients
    go to the wire unscaled, as FSDP handed them, so small ones keep their fp16 bits (a pre-scale of 1/2 would
    push them towards fp16's subnormals, where bits are lost)."""
    plain = make_model()
    model = shard(make_model(), world_size)
    for module in model.modules():
        if isinstance(module, fsdp_api.FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    ddp_triton.fsdp.register(model, comm_dtype=torch.float16)
    x, y = data(0)
    per = BATCH // world_size

    def small_loss(m, r):  # small gradients
        return nn.functional.mse_loss(m(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per]) * 1e-3

    per_rank = []
    for r in range(world_size):
        copy_ = copy.deepcopy(plain)
        small_loss(copy_, r).backward()
        per_rank.append([q.grad.clone() for q in copy_.parameters()])
    small_loss(model, rank).backward()
    for i, p in enumerate(model.parameters()):
        sent = [g[i].to(torch.float16).float() for g in per_rank]
        total = sent[0]
        for value in sent[1:]:  # in rank order from the first rank's value, as the float32 sum adds
            total = total + value
        total = total / world_size
        rows = -(-total.shape[0] // world_size)
        want = total[rank * rows:(rank + 1) * rows]
        assert torch.equal(p.grad.to_local().contiguous().view(torch.int32), want.contiguous().view(torch.int32)), i


def test_fp16_when_fsdp_sums_is_not_scaled_twice():
    torch_path_workers(_fp16_sum_worker, 4)
