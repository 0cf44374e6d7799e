"""The residual store's bookkeeping by parameter identity: a layout found again only for the same sizes, and what a
bucket without error feedback takes in (every rank's first stage and the second, summed once).

Tier: gloo, 2 processes spawned here (the store's re-slice and fold are collective)."""

import torch
import torch.distributed as dist

from dist_utils import run_workers
from ddp_triton.kernels import block_layout
from ddp_triton.runtime.residuals import ResidualStore


def _bound_two_parameters(world_size):
    """A store with one layout bound: parameters 1 and 2, of 300 and 212 elements."""
    store, group, sizes = ResidualStore(), dist.group.WORLD, (300, 212)
    return store, group, sizes, store.for_layout((1, 2), sizes, [block_layout(sizes, world_size)], group,
                                                 torch.device("cpu"))


def _same_ids_other_sizes(rank, world_size):
    store, group = ResidualStore(), dist.group.WORLD
    old = store.for_layout((7,), (256,), [block_layout((256,), world_size)], group, torch.device("cpu"))
    old.first.fill_(1.0)
    # The id 7 now names a parameter of 512 elements (Python reuses ids): a layout of its own, the old one retired.
    new = store.for_layout((7,), (512,), [block_layout((512,), world_size)], group, torch.device("cpu"))
    assert new is not old and new.n_elements == 512 and not old.alive
    assert store.for_layout((7,), (512,), [block_layout((512,), world_size)], group, torch.device("cpu")) is new


def test_a_layout_is_found_again_only_for_the_same_sizes():
    run_workers(_same_ids_other_sizes, 2)


def _fold(rank, world_size):
    store, group = ResidualStore(), dist.group.WORLD
    held = store.for_layout((1, 2), (100, 60), [block_layout((100, 60), world_size)], group, torch.device("cpu"))
    held.first.fill_(float(rank + 1))  # rank 0: 1, rank 1: 2
    held.second.fill_(0.25)  # each rank's own rows: every element's second stage is 0.25
    # A bucket of parameter 2 alone, in a format without error feedback, takes what it is owed; parameter 1 waits.
    owed = store.take_for_fold((2,), (60,), group, torch.device("cpu"))
    assert torch.equal(owed, torch.full((60,), 1.0 + 2.0 + 0.25))
    assert not held.alive and 2 not in store.pending_first and 1 in store.pending_first
    assert store.take_for_fold((2,), (60,), group, torch.device("cpu")) is None  # once only
    assert store.take_for_fold((3,), (10,), group, torch.device("cpu")) is None  # nothing held for it


def test_a_bucket_without_error_feedback_takes_every_ranks_residuals_once():
    run_workers(_fold, 2)


def _snapshot_and_regroup(rank, world_size):
    store, group, sizes, held = _bound_two_parameters(world_size)
    held.first.fill_(float(rank + 1))
    held.second.fill_(0.5)
    saved = store.snapshot()
    held.first.add_(3.0)  # a step that is then thrown away
    held.second.zero_()
    store.restore(saved)
    assert torch.equal(held.first, torch.full_like(held.first, float(rank + 1)))
    assert torch.equal(held.second, torch.full_like(held.second, 0.5))
    # The group changes (a peer gone): nothing collective; each rank keeps its first stage and its own second rows.
    whole_before = held.whole_second(None)
    store.release_locally()
    assert not held.alive and not store.layouts
    again = store.for_layout((1, 2), sizes, [block_layout(sizes, world_size)], None, torch.device("cpu"), shard=rank)
    assert torch.equal(again.first, torch.full_like(again.first, float(rank + 1))[:again.first.numel()])
    # the same layout and shard: this rank owns again exactly the rows it held
    assert torch.equal(again.whole_second(None), whole_before)
    store.zero()
    assert not again.first.any() and not again.second.any() and not store.pending_first


def test_a_thrown_away_step_is_restored_and_a_new_group_takes_what_each_rank_held():
    run_workers(_snapshot_and_regroup, 2)


def _move_to_a_new_layout(rank, world_size):
    store, group, sizes, held = _bound_two_parameters(world_size)
    gen = torch.Generator().manual_seed(rank)
    held.second.copy_(torch.randn(held.second.numel(), generator=gen))  # each rank's own rows, bfloat16 values
    before = held.whole_second(group)
    by_param = {1: before[:300], 2: before[300:]}
    moved = []
    all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        moved.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:  # DDP's rebuild: the same parameters, the other order, so every element's block and owner change
        again = store.for_layout((2, 1), (212, 300), [block_layout((212, 300), world_size)], group,
                                 torch.device("cpu"))
    finally:
        dist.all_reduce = all_reduce
    after = again.whole_second(group)
    assert torch.equal(after[:212].bfloat16().view(torch.int16), by_param[2].bfloat16().view(torch.int16))  # moved
    assert torch.equal(after[212:].bfloat16().view(torch.int16), by_param[1].bfloat16().view(torch.int16))
    assert moved == [2 * sum(sizes)]  # one gather of 2 bytes an element, the residuals' own dtype


def test_a_new_layout_takes_the_second_stage_bit_for_bit_in_one_bfloat16_gather():
    run_workers(_move_to_a_new_layout, 2)


def _second_stage_joins_the_first_at_two(rank, world_size):
    store, group, sizes, held = _bound_two_parameters(world_size)
    held.first.fill_(0.5 * (rank + 1))
    held.second.fill_(0.25)  # what requantizing the sums left: 0.25 an element, each element's on one rank
    owed_before = torch.zeros(sum(sizes))
    owed_before += held.first_in_bucket().float() + held.whole_second(None).float()
    dist.all_reduce(owed_before)
    # The same parameters bound again by an exchange with no second rounding (two ranks: one all-gather).
    again = store.for_layout((2, 1), (212, 300), [block_layout((212, 300), world_size)], group,
                             torch.device("cpu"), second_stage=False)
    assert not again.second.any()
    owed_after = again.first_in_bucket().float()
    dist.all_reduce(owed_after)
    by_param_before = {1: owed_before[:300], 2: owed_before[300:]}
    assert torch.equal(owed_after[:212], by_param_before[2]) and torch.equal(owed_after[212:], by_param_before[1])
    assert set(again.first.unique().tolist()) == {0.5 * (rank + 1), 0.5 * (rank + 1) + 0.25}  # the owner adds it


def test_at_two_ranks_the_second_stage_owed_is_sent_with_the_first_once():
    run_workers(_second_stage_joins_the_first_at_two, 2)
