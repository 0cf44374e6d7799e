"""The two-level exchange (``hierarchical=True``) under real DDP at 2 nodes x 2 ranks.

Tier: gloo multi-process on CPU on the kernels' torch path; each worker is told its node as torchrun tells it
(``GROUP_RANK``). Every rank also averages every rank's local gradients with ``wire_reference.two_level_average``
(written from the definition) over the buckets DDP handed the hook, in their order: the trained parameters must
have the same bits, step after step, across DDP's rebuild, with FP8 residuals carried per parameter.
"""

import copy
import logging
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_helpers import local_backward, local_grads, torch_path_workers
from test_wire_formats import Wide, assert_same_params, data, resume_matches_unbroken
from wire_reference import two_level_average
from ddp_triton.formats import WireFormat

LOCAL = 2  # ranks per node


class TwoLevelReference:
    """Training on one process: every rank's gradients averaged per bucket with the two-level reference."""

    def __init__(self, model, options, world_size, lr=0.05, nodes=None):
        self.model, self.world_size, self.nodes = copy.deepcopy(model), world_size, nodes
        wire = WireFormat.from_options(**options)
        self.fmt, self.float32_sums, self.feedback = wire.comm_dtype, wire.fp32_sum, wire.error_feedback
        self.params = list(self.model.parameters())
        nodes = world_size // LOCAL
        self.first = [[torch.zeros(p.numel()) for p in self.params] for _ in range(nodes)]
        self.second = [torch.zeros(p.numel()) for p in self.params]
        self.opt = torch.optim.SGD(self.params, lr=lr, momentum=0.9)

    def step(self, x, y, buckets):
        per_rank = [local_grads(self.model, [(x, y)], r, self.world_size) for r in range(self.world_size)]
        for order in buckets:
            sizes = [self.params[i].numel() for i in order]
            flat = [torch.cat([grads[i].reshape(-1).float() for i in order]) for grads in per_rank]
            first = [torch.cat([node[i] for i in order]) for node in self.first] if self.feedback else None
            second = torch.cat([self.second[i] for i in order]) if self.feedback else None
            averaged = two_level_average(flat, sizes, LOCAL, self.fmt, self.float32_sums, first, second, self.nodes)
            offset = 0
            for i, size in zip(order, sizes):
                part = slice(offset, offset + size)
                self.params[i].grad = averaged[part].view_as(self.params[i]).to(self.params[i].dtype)
                if self.feedback:
                    for node, values in zip(self.first, first):
                        node[i] = values[part].clone()
                    self.second[i] = second[part].clone()
                offset += size
        self.opt.step()


def recording_state(ddp, options):
    """Register the hook through a wrapper that records each bucket's parameters (as DDP hands them) per step."""
    state = ddp_triton.CommState(process_group=ddp.process_group, hierarchical=True, **options)
    state.name_parameters(ddp.module)
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    buckets = []

    def recording(state, bucket):
        buckets.append([index[id(p)] for p in bucket.parameters()])
        return ddp_triton.triton_hook(state, bucket)

    ddp.register_comm_hook(state, recording)
    return state, buckets


class Tiny(torch.nn.Module):
    """36 elements: one bucket smaller than one block, so the node's second rank has an empty part."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.layer(x)


def _same_bits_worker(rank, world_size, options, bucket_cap_mb, steps=4, model_class=Wide):
    os.environ["GROUP_RANK"] = str(rank // LOCAL)  # what torchrun tells each worker
    return check_against_reference(rank, world_size, options, bucket_cap_mb, steps, model_class)


def check_against_reference(rank, world_size, options, bucket_cap_mb, steps=4, model_class=Wide, nodes=None):
    """Train ``model_class`` under DDP with hierarchical=True for ``steps`` steps, the parameters' bits checked
    against the reference after each; the nodes are what the environment says (``nodes``: their ranks, if not
    consecutive). Returns the state."""
    model = model_class()
    reference = TwoLevelReference(model, options, world_size, nodes=nodes)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    state, buckets = recording_state(ddp, options)
    nodes = state.context.nodes
    assert nodes is not None and (nodes.n_nodes, nodes.local_size) == (world_size // LOCAL, LOCAL)
    assert state.wire.name.startswith("two-level ")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = data(step)
        buckets.clear()
        opt.zero_grad()
        local_backward(ddp, x, y, rank, world_size)
        opt.step()
        reference.step(x, y, buckets)
        assert_same_params(ddp.module, reference.model, step)
    return state


def _every_format_worker(rank, world_size):
    for options in (dict(comm_dtype=torch.float8_e4m3fn), dict(comm_dtype=torch.float8_e5m2, error_feedback=False),
                    dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32), dict(comm_dtype=torch.bfloat16),
                    dict(comm_dtype="fp4e2m1+ef")):
        wire = WireFormat.from_options(**options)
        for bucket_cap_mb in (25, 0.002):  # one bucket (its order reversed at the rebuild); one or two per tensor
            state = _same_bits_worker(rank, world_size, options, bucket_cap_mb)
            summary = state.summary()
            # Between nodes: the part of 1/L of the bucket (padded to whole blocks) in the wire format.
            cross = summary.between_nodes_bytes_per_step
            assert cross == sum(n for b in summary.buckets for fmt, n in b.wire_bytes.items() if "(node)" not in fmt)
            assert "between nodes" in summary.headline(), summary.headline()
            per_element = wire.bytes_per_element
            elements = summary.fp32_bytes_per_step / 4
            assert cross >= elements / LOCAL * per_element, str(summary)
            assert cross <= (elements / LOCAL + 128 * 2 * len(summary.buckets)) * per_element + 264 * 2, str(summary)
            # Every bucket: the node's sum, the exchange between the nodes, the node's all-gather. Between two nodes
            # 16 bits with float32 sums is one all-reduce (the same bits), FP8 and E2M1 one all-gather of the rows.
            stages = 3
            assert {len(e.exchange.stages) for e in state.plans.values()} == {stages}, str(summary)
            # The hop between nodes measured its rounding at each bucket's first pass (block-scaled formats only).
            rounded = [b for b in summary.buckets if b.rounding_pass is not None]
            assert len(rounded) == (len(summary.buckets) if wire.block_scaled else 0), str(summary)
            bound = {8: 0.1, 4: 0.2}.get(wire.dtype.bits)  # E5M2 keeps 2 mantissa bits, E4M3 3, E2M1 1
            assert all(0 < b.rounding_error < bound for b in rounded), str(summary)


def _three_nodes_worker(rank, world_size):
    state = _same_bits_worker(rank, world_size, dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32), 25,
                              steps=2)
    # Between three nodes the float32 sums take the all-to-all and the all-gather: 4 collectives a bucket.
    assert {len(e.exchange.stages) for e in state.plans.values()} == {4}


def test_two_level_between_three_nodes_sums_in_float32_by_all_to_all():
    """3 nodes x 2 ranks, bf16 with float32 sums: the exchange between the nodes that two nodes do not take (there it
    is one all-reduce), against the reference."""
    torch_path_workers(_three_nodes_worker, 3 * LOCAL, timeout=240)


def test_two_level_same_bits_as_the_reference():
    """FP8 E4M3 with error feedback, E5M2 without, bf16 with float32 sums, plain bf16, E2M1 with error feedback (4
    bits between nodes only): 2 nodes x 2 ranks."""
    torch_path_workers(_every_format_worker, 4, timeout=240)


def _tiny_worker(rank, world_size):
    for options in (dict(comm_dtype=torch.float8_e4m3fn), dict(comm_dtype=torch.bfloat16,
                                                               accumulate_dtype=torch.float32)):
        state = _same_bits_worker(rank, world_size, options, 25, steps=3, model_class=Tiny)
        part_elements = [e.exchange.held[1].numel() for e in state.latest_pass()]
        assert part_elements == [128], part_elements  # 36 elements: one block per part, the second part empty


def test_two_level_bucket_smaller_than_a_part():
    torch_path_workers(_tiny_worker, 4)


def _interleaved_worker(rank, world_size):
    os.environ["GROUP_RANK"] = str((0, 1, 1, 0)[rank])  # node 0: ranks 0 and 3, node 1: ranks 1 and 2
    state = check_against_reference(rank, world_size, dict(comm_dtype=torch.float8_e4m3fn), 25,
                                    nodes=[[0, 3], [1, 2]])
    nodes = state.context.nodes
    assert (nodes.local_index, nodes.node_index) == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}[rank]


def test_two_level_nodes_whose_ranks_interleave():
    """The cross exchange's shards follow the cross group's rank order; the FP8 residuals must follow them, across
    DDP's rebuild (one bucket whose order it reverses)."""
    torch_path_workers(_interleaved_worker, 4)


class _StandInWork:
    """What the exchange queue asks of a collective's work: its future."""

    def __init__(self, future):
        self._future = future

    def get_future(self):
        return self._future


def _stand_in_reduce_scatter(output, input, group):
    """A reduce-scatter with a future, as NCCL's: the node's sum (here an all-reduce of the whole send buffer,
    which the node all-gather overwrites anyway), then this rank's part of it into ``output``."""
    k, part = dist.get_rank(group), output.numel()

    def take(future):
        future.value()
        output.copy_(input[k * part:(k + 1) * part])
        return output

    return _StandInWork(dist.all_reduce(input, group=group, async_op=True).get_future().then(take))


def _reduce_scatter_worker(rank, world_size):
    from ddp_triton.runtime import nodes, two_level

    nodes._reduce_scatter_has_future = lambda group, size: True
    two_level.reduce_scatter_single = _stand_in_reduce_scatter
    os.environ["GROUP_RANK"] = str(rank // LOCAL)
    for options in (dict(comm_dtype=torch.float8_e4m3fn), dict(comm_dtype=torch.bfloat16)):
        state = check_against_reference(rank, world_size, options, 0.004)
        assert state.context.nodes.reduce_scatter
        stages = [stage.collective_phase for stage in state.latest_pass()[0].exchange.stages]
        assert stages[0] == "reduce_scatter", stages


def test_two_level_reduce_scatter_path_with_a_stand_in_reduce_scatter():
    """The path NCCL takes (a reduce-scatter with a future; gloo's has none, so elsewhere the node's sum is an
    all-reduce and a copy): this rank's part arrives straight in its shard, the same bits as the reference, across
    several buckets and DDP's rebuild. NCCL's own reduce-scatter is not run here (no GPU)."""
    torch_path_workers(_reduce_scatter_worker, 4, timeout=180)


def _after_a_subgroup_worker(rank, world_size):
    world = dist.distributed_c10d._world
    counted = world.group_count
    dist.new_group([0, 1], use_local_synchronization=True)  # made by two ranks only: the others never see it
    if rank < 2 and world.group_count == counted:
        world.group_count += 1  # as torch >= 2.14 counts such a group: its two ranks are a group ahead of the others
    os.environ["GROUP_RANK"] = str(rank // LOCAL)
    check_against_reference(rank, world_size, dict(comm_dtype=torch.bfloat16), 25, steps=2)


def test_two_level_binds_after_a_subgroup_only_some_ranks_made():
    torch_path_workers(_after_a_subgroup_worker, 4, timeout=90)


def _own_parts_only(saved):
    assert saved["wire_format"] == "two-level fp8e4m3+ef"
    # Each rank holds the first stage of its own part of each bucket: some of it, not all of it.
    held = torch.cat([t.view(-1) != 0 for t in saved["first_stage"].values()])
    assert 0 < held.sum() < held.numel()


def _checkpoint_worker(rank, world_size, tmp):
    os.environ["GROUP_RANK"] = str(rank // LOCAL)
    # The fresh model starts in constructor bucket order: the parts move between the node's ranks.
    checkpoint = resume_matches_unbroken(rank, world_size, tmp, dict(comm_dtype=torch.float8_e4m3fn,
                                                                     hierarchical=True), 0.004, _own_parts_only)
    model = Wide()
    # A flat state refuses the two-level residuals (the first stage means another thing there).
    flat = ddp_triton.CommState(comm_dtype=torch.float8_e4m3fn)
    flat.name_parameters(model)
    with pytest.raises(ValueError, match="wire_format='two-level fp8e4m3\\+ef', this state has 'fp8e4m3\\+ef'"):
        flat.load_state_dict(checkpoint["hook"])


def test_two_level_fp8_checkpoint_resumes_bit_identically(tmp_path):
    torch_path_workers(_checkpoint_worker, 4, str(tmp_path), timeout=240)


def _fallback_worker(rank, world_size, node_of_rank, caplog_level):
    os.environ["GROUP_RANK"] = str(node_of_rank[rank])
    logging.getLogger("ddp_triton").setLevel(caplog_level)
    state = ddp_triton.register(DDP(Wide()), comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32,
                                hierarchical=True)
    assert state.context.nodes is None and state.wire.name == "bf16+fp32sum", state.wire.name
    _same_flat_bits(rank, world_size, state)


def _same_flat_bits(rank, world_size, state):
    x, y = data(0)
    ddp = DDP(Wide())
    ddp.register_comm_hook(state, ddp_triton.triton_hook)
    local_backward(ddp, x, y, rank, world_size)
    grads = torch.cat([p.grad.view(-1) for p in ddp.parameters()])
    gathered = [torch.empty_like(grads) for _ in range(world_size)]
    dist.all_gather(gathered, grads)
    assert all(torch.equal(g, grads) for g in gathered)


@pytest.mark.parametrize("node_of_rank", [(0, 0), (0, 1)], ids=["one-node", "one-rank-per-node"])
def test_one_node_or_one_rank_per_node_goes_flat(node_of_rank):
    torch_path_workers(_fallback_worker, 2, node_of_rank, logging.WARNING)


def _unequal_nodes_worker(rank, world_size):
    os.environ["GROUP_RANK"] = str(0 if rank < 2 else 1)
    with pytest.raises(ValueError, match="same number of ranks on every node; the 2 nodes have 2, 1 ranks"):
        ddp_triton.register(DDP(Wide()), comm_dtype=torch.float8_e4m3fn, hierarchical=True)


def test_nodes_of_different_sizes_fail_on_every_rank():
    torch_path_workers(_unequal_nodes_worker, 3)


def _disagreement_worker(rank, world_size):
    os.environ["GROUP_RANK"] = str(rank // LOCAL)
    with pytest.raises(RuntimeError, match=r"ranks disagree on the wire format \(rank 0: two-level fp8e4m3\+ef; "
                                           r"rank 1: fp8e4m3\+ef; rank 2: fp8e4m3\+ef; rank 3: fp8e4m3\+ef\)"):
        ddp_triton.register(DDP(Wide()), comm_dtype=torch.float8_e4m3fn, hierarchical=rank == 0)


def test_ranks_that_disagree_on_hierarchical_fail_together():
    torch_path_workers(_disagreement_worker, 4)


def test_parts_are_whole_blocks_and_pieces():
    from ddp_triton.machine.cost_model import two_level_part
    from ddp_triton.runtime.chunks import pieces_within

    assert two_level_part(3904, 2) == 2048  # 31 blocks: 16 and 15
    assert two_level_part(4, 2) == 128  # the second part is empty
    assert two_level_part(1, 8) == 128
    assert all(two_level_part(n, k) % 128 == 0 and two_level_part(n, k) * k >= n
               for n in (1, 127, 128, 129, 10_000) for k in (1, 2, 3, 8))
    assert pieces_within([4, 1200, 300, 2400], 0, 2048) == [4, 1200, 300, 544]
    assert pieces_within([4, 1200, 300, 2400], 2048, 3904) == [1856]
    assert pieces_within([4], 128, 128) == []
    assert math.isclose(sum(pieces_within([5, 7, 9], 3, 15)), 12)
