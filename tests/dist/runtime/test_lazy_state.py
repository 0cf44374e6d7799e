"""A CommState built before ``init_process_group``: settings only, bound at its first bucket or at ``register``.

Frameworks want the state when they are configured, before they create the process group (Lightning's
``DDPStrategy(ddp_comm_state=...)``). Tiers: no device (construction and its checks, in this process, where no
group exists), and gloo multi-process on CPU (world size 2, spawned here, the workers starting without a group), the
kernels on their torch CPU path. With float32 on the wire at world size 2 the hook computes what DDP's default
reduction does (x * 0.5 is x / 2 exactly, then the same sum), so the weights are compared bit for bit.
"""

import copy
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from dist_utils import init_gloo, run_workers
from ddp_triton.runtime.algo_groups import scoped_env
from ddp_triton.runtime.state import CommState
from ddp_helpers import local_backward, make_data, make_model, train_ddp, two_range_profile
from ddp_triton.machine.profile import ProfileError

STEPS = 4


def lazy_workers(fn, world_size, *args):
    """Workers on the kernels' torch CPU path that start without a process group (``init_gloo`` joins it)."""
    with scoped_env({"TRITON_INTERPRET": "0"}):
        run_workers(fn, world_size, *args, timeout=120, init=False)


def assert_same_weights(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), f"{name} differs from DDP without a hook"


@pytest.fixture
def no_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")


def test_built_before_the_process_group_holds_its_settings(no_process_group):
    state = CommState(comm_dtype=torch.float32, profile=None)
    assert state.context is None and state.passes == 0 and state.plans == {}
    assert state.comm_dtype == torch.float32 and state.process_group is None and state.context is None
    # pickles like a restored state: settings only, still unbound
    again = pickle.loads(pickle.dumps(state))
    assert not again.bound and again.comm_dtype == torch.float32 and again.profile is None
    with pytest.raises(RuntimeError, match="init_process_group"):
        state.bind()


@pytest.mark.parametrize("options, error, match", [
    pytest.param(dict(comm_dtype=torch.float64), ValueError, "comm_dtype", id="float64"),
    pytest.param(dict(comm_dtype=torch.int8), ValueError, "comm_dtype", id="int8"),
    pytest.param(dict(profile=42), TypeError, "profile must be", id="profile-int"),
])
def test_bad_settings_are_refused_at_construction_without_a_group(no_process_group, options, error, match):
    with pytest.raises(error, match=match):
        CommState(**options)


def _first_bucket_worker(rank, world_size):
    state = CommState(comm_dtype=torch.float32)  # profile "auto": resolved at the first bucket (gloo: none)
    assert not state.bound
    init_gloo(rank, world_size)
    assert not state.bound, "a state built before the group stays unbound until its first bucket"
    model = make_model()
    plain = DDP(copy.deepcopy(model), bucket_cap_mb=0.002)
    ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets
    ddp.register_comm_hook(state, ddp_triton.triton_hook)
    assert not state.bound
    train_ddp(ddp, rank, world_size, STEPS)
    train_ddp(plain, rank, world_size, STEPS)
    assert state.bound and state.context.group is dist.group.WORLD and state.context.world_size == world_size
    assert state.context.backend == "gloo" and state.context.profile is None and state.device is None
    assert state.passes == STEPS, "the hook averaged every backward"
    assert len(state.plans) > 1 and {e.wire_buffer.dtype for e in state.plans.values()} == {torch.float32}
    assert_same_weights(ddp.module, plain.module)


def test_state_built_before_init_binds_at_its_first_bucket():
    lazy_workers(_first_bucket_worker, 2)


def _register_worker(rank, world_size):
    state = CommState(comm_dtype=torch.float32, profile=None)
    init_gloo(rank, world_size)
    model = make_model()
    plain = DDP(copy.deepcopy(model))
    ddp = DDP(model)
    pair = dist.new_group([0, 1])
    with pytest.raises(TypeError, match="not both"):
        ddp_triton.register(ddp, state=state, comm_dtype=torch.float16)
    ddp = DDP(model, process_group=pair)
    assert ddp_triton.register(ddp, state=state) is state
    assert state.bound and state.context.group is pair, "bound at register, to the model's group"
    train_ddp(ddp, rank, world_size, STEPS)
    train_ddp(plain, rank, world_size, STEPS)
    assert state.passes == STEPS
    assert_same_weights(ddp.module, plain.module)


def test_state_built_before_init_binds_at_register():
    lazy_workers(_register_worker, 2)


def _disagreement_worker(rank, world_size):
    # each rank holds a different table, given before any group exists: nothing can be compared yet ...
    state = CommState(comm_dtype=torch.float32, profile=two_range_profile(world_size, split=4096 + rank))
    init_gloo(rank, world_size)
    ddp = DDP(make_model())
    ddp.register_comm_hook(state, ddp_triton.triton_hook)
    x, y = make_data(0)
    # ... so every rank fails at the first bucket, where the state binds
    with pytest.raises(RuntimeError, match="ranks disagree on the tuning profile"):
        local_backward(ddp, x, y, rank, world_size)
    assert state.context is None and state.passes == 0


def test_ranks_disagreeing_on_a_lazy_profile_all_fail_at_the_first_bucket():
    lazy_workers(_disagreement_worker, 2)


def _unreadable_on_one_rank_worker(rank, world_size, tmp, at):
    path = os.path.join(tmp, f"tuned-rank{rank}.json")  # node-local: rank 1's copy is missing
    if rank == 0:
        two_range_profile(world_size).save(path)
    # given before any group exists: the file is read when the state binds, on every rank
    state = CommState(comm_dtype=torch.float32, profile=path)
    init_gloo(rank, world_size)
    ddp = DDP(make_model())
    expected = "cannot read profile: No such file" if rank == 1 else r"rank\(s\) \[1\] cannot use the profile"
    if at == "register":
        with pytest.raises(ProfileError, match=expected):
            ddp_triton.register(ddp, state=state)
        assert ddp._comm_hooks == []
    else:  # torch's way: the state binds at its first bucket, inside DDP's backward, and every rank raises there
        ddp.register_comm_hook(state, ddp_triton.triton_hook)
        x, y = make_data(0)
        with pytest.raises(ProfileError, match=expected):
            local_backward(ddp, x, y, rank, world_size)
    assert state.context is None and state.passes == 0


@pytest.mark.parametrize("at", ["register", "first-bucket"])
def test_a_profile_file_missing_on_one_rank_fails_every_rank_when_a_lazy_state_binds(tmp_path, at):
    lazy_workers(_unreadable_on_one_rank_worker, 2, str(tmp_path), at)
