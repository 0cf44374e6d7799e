"""A CommState that can be saved: torch.save/torch.load of a whole DDP model, copy.deepcopy, plain pickle.

Tier: gloo multi-process on CPU (world size 2, spawned here), kernels on their torch CPU path, bfloat16 on the wire
unless said; the states pickled in another format are refused without processes. A restored model is compared with
one that was never saved, trained on the same data: bit for bit, since both run the same hook on the same gradients
and only DDP's bucket layout differs (the hook works element by element). torch rebuilds DDP's reducer on unpickling
without its comm hook, so the restored model is given its hook back with ``ddp_triton.reattach``; the tests check
the restored state did the averaging.
"""

import copy
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_triton.runtime.state import CommState
from ddp_helpers import local_backward, make_data, make_model, torch_path_workers

WORLD = 2


def train(ddp, rank, world_size, steps, first_step=0):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)  # no momentum: nothing but the weights carries over
    for step in range(first_step, first_step + steps):
        x, y = make_data(step)
        opt.zero_grad()
        local_backward(ddp, x, y, rank, world_size)
        opt.step()


def assert_same_weights(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), f"{name} differs from the model that was never saved"


class _Spy(pickle.Pickler):
    """Records the type of every object pickled (besides the atoms pickle writes directly)."""

    def __init__(self, file):
        super().__init__(file)
        self.seen = set()

    def reducer_override(self, obj):
        self.seen.add(type(obj))
        return NotImplemented


def _contents_worker(rank, world_size, tmp):
    import io

    ddp = DDP(make_model(), bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, comm_dtype=torch.float16)
    train(ddp, rank, world_size, steps=1)
    assert state.plans and state.held_bytes() > 0  # buffers and launches bound: none of them may travel
    buf = io.BytesIO()
    spy = _Spy(buf)
    spy.dump(state)
    kinds = {f"{t.__module__}.{t.__qualname__}" for t in spy.seen}
    assert not [k for k in kinds if "ProcessGroup" in k or "Tensor" in k or "Storage" in k or "function" in k
                or "runtime.plan" in k or "runtime.context" in k], kinds
    data = buf.getvalue()
    for needle in (b"ProcessGroup", b"_rebuild_tensor", b"Storage", b"kernels", b"runtime.plan", b"runtime.context"):
        assert needle not in data, f"{needle!r} in the pickled state"
    restored = pickle.loads(data)
    assert restored.comm_dtype == torch.float16 and restored.process_group is None and restored.plans == {}
    assert restored.profile == "auto", "the profile argument as given, resolved again when the state binds"
    # A profile given as a path stays that path (here one that does not exist: not resolved until binding).
    as_path = CommState(comm_dtype=torch.float32, profile=None)
    as_path.profile = os.path.join(tmp, "profile.json")
    assert pickle.loads(pickle.dumps(as_path)).profile == os.path.join(tmp, "profile.json")
    # A state on another group than the default one does not fall back to averaging over the world.
    pair = dist.new_group([0, 1])
    on_pair = pickle.loads(pickle.dumps(CommState(process_group=pair, profile=None)))
    with pytest.raises(ValueError, match="process_group"):
        on_pair.averaging_group()
    on_pair.process_group = pair
    assert on_pair.averaging_group() is pair
    on_world = pickle.loads(pickle.dumps(CommState(process_group=dist.group.WORLD, profile=None)))
    assert on_world.averaging_group() is dist.group.WORLD


def test_pickled_state_holds_settings_only(tmp_path):
    torch_path_workers(_contents_worker, WORLD, str(tmp_path))


class _Pickled:
    """Pickles as a CommState whose saved settings are ``saved``: what an earlier ddp-triton wrote."""

    def __init__(self, saved):
        self.saved = saved

    def __reduce__(self):
        return CommState.__new__, (CommState,), self.saved  # unpickled as any object: made, then __setstate__


@pytest.mark.parametrize("version, absent", [
    pytest.param(1, ("accumulate_dtype", "error_feedback", "hierarchical", "grad_stats", "timing"), id="format-1"),
    pytest.param(2, ("hierarchical", "grad_stats", "timing"), id="format-2"),
    pytest.param(3, ("grad_stats", "timing"), id="format-3"),
    pytest.param(4, ("tune", "formats"), id="format-4-before-online-tuning"),
    pytest.param(6, (), id="newer-format"),
])
def test_a_state_pickled_in_another_format_is_refused_saying_what_to_do(version, absent):
    # No processes: unpickling only reads settings. Each earlier format lacked the settings added after it.
    saved = CommState(profile=None, comm_dtype=torch.float16).__getstate__()
    assert pickle.loads(pickle.dumps(_Pickled(saved))).comm_dtype == torch.float16  # the current format loads
    old = {**{k: v for k, v in saved.items() if k not in absent}, "version": version}
    with pytest.raises(ValueError) as raised:
        pickle.loads(pickle.dumps(_Pickled(old)))
    message = str(raised.value)
    assert f"pickled in format {version} by another ddp-triton; this one reads format 5 only" in message, message
    assert "ddp_triton.register(" in message and "\n" not in message


def _save_load_worker(rank, world_size, tmp):
    path = os.path.join(tmp, "ddp.pt")
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp)  # bfloat16
    train(ddp, rank, world_size, steps=1)
    if rank == 0:
        torch.save(ddp, path)
    dist.barrier()
    loaded = torch.load(path, weights_only=False)
    assert_same_weights(loaded.module, model)
    restored = ddp_triton.reattach(loaded)
    assert isinstance(restored, CommState) and restored is not state and restored.plans == {}
    train(ddp, rank, world_size, steps=2, first_step=1)
    train(loaded, rank, world_size, steps=2, first_step=1)
    assert_same_weights(loaded.module, model)
    # the restored state did the averaging, on the default group, in bfloat16
    assert restored.plans and restored.context.group is dist.group.WORLD and restored.comm_dtype == torch.bfloat16
    assert {e.wire_buffer.dtype for e in restored.plans.values()} == {torch.bfloat16}


def test_torch_save_and_load_of_a_whole_ddp_model(tmp_path):
    torch_path_workers(_save_load_worker, WORLD, str(tmp_path))


def _deepcopy_worker(rank, world_size):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, comm_dtype=torch.float16)
    train(ddp, rank, world_size, steps=1)
    twin = copy.deepcopy(ddp)
    twin_state = ddp_triton.reattach(twin)
    assert twin_state is not state and twin_state.comm_dtype == torch.float16
    with pytest.raises(RuntimeError):  # the original still has its hook: torch refuses a second one
        ddp_triton.reattach(ddp)
    assert ddp._comm_hooks == [(ddp_triton.triton_hook, state)], "a refused reattach leaves the model as it was"
    train(ddp, rank, world_size, steps=2, first_step=1)
    train(twin, rank, world_size, steps=2, first_step=1)
    assert_same_weights(twin.module, model)
    assert twin_state.plans, "the copy's own state did the averaging"
    # an unpickled model that never carried the hook says so
    plain = copy.deepcopy(DDP(make_model()))
    with pytest.raises(ValueError, match="no triton_hook"):
        ddp_triton.reattach(plain)


def test_deepcopy_of_a_ddp_model_with_the_hook():
    torch_path_workers(_deepcopy_worker, WORLD)
