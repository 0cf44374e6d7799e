"""Error-feedback residuals in checkpoints: what load_state_dict refuses, shared states, reattached models, states
not bound yet, and what a huge finite gradient does to the norm under error feedback.

Tier: gloo multi-process on CPU (world size 2, one spawned job for the distributed cases), on the kernels' torch path;
plus settings checks that need no process group.
"""

import copy
import io
import math
import pickle

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_triton.runtime.state import check_options
from ddp_helpers import local_backward, make_data, torch_path_workers


FP8_EF = dict(comm_dtype=torch.float8_e4m3fn)  # error feedback on by default


class Net(nn.Module):
    def __init__(self, width=40):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, width)
        self.second = nn.Linear(width, 4)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def trained(width=40, steps=2, options=FP8_EF, rank=0, world_size=2, state=None, model=None):
    """A DDP model of ``Net(width)`` with the hook, after ``steps`` steps; (ddp, state)."""
    ddp = DDP(model if model is not None else Net(width), bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, **options) if state is None else ddp_triton.register(ddp, state=state)
    train(ddp, steps, rank, world_size)
    return ddp, state


def train(ddp, steps, rank, world_size):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(steps):
        x, y = make_data(step)
        opt.zero_grad()
        local_backward(ddp, x, y, rank, world_size)
        opt.step()


def same_dicts(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert a[key].keys() == b[key].keys(), key
            assert all(torch.equal(a[key][n], b[key][n]) for n in a[key]), key
        else:
            assert a[key] == b[key], key


def _refusals(rank, world_size):
    _, state = trained(40, rank=rank)
    saved = state.state_dict()
    ddp, other = trained(50, rank=rank)  # same names, other widths
    before = other.state_dict()

    def refused(bad, match):
        with pytest.raises(ValueError, match=match):
            other.load_state_dict(bad)
        same_dicts(other.state_dict(), before)  # left as it was

    refused(saved, r"first_stage residual of (first.weight has 320 elements; the parameter has 400 \(shape \(50, 8\)"
                   r"|second.weight has 160 elements; the parameter has 200 \(shape \(4, 50\))\)")
    _, right = trained(50, rank=rank)
    good = right.state_dict()
    refused({**good, "wire_format": "bf16+fp32sum"}, "for wire_format='bf16\\+fp32sum', this state has 'fp8e4m3\\+ef'")
    refused({**good, "rank": 1 - rank}, f"rank {1 - rank} of 2's .* this is rank {rank} of 2")
    refused({**good, "world_size": 3}, f"rank {rank} of 3's")
    refused({k: v for k, v in good.items() if k != "first_stage"}, "has no first_stage")
    refused({**good, "second_stage": {**good["second_stage"], "third.weight": torch.zeros(3)}},
            "name a parameter 'third.weight'")
    refused({**good, "first_stage": {**good["first_stage"], "first.bias": torch.zeros(50, dtype=torch.float64)}},
            "first_stage residual of first.bias is torch.float64")
    refused({**good, "first_stage": [1, 2]}, "not a dict of tensors")
    # Residuals are bfloat16 (format 2): an earlier build's float32 file says what to do; a float32 tensor is refused
    refused({**good, "version": 1}, r"saved by an earlier ddp-triton \(format 1, float32 residuals\).*without the "
                                    r"hook's entry")
    refused({**good, "first_stage": {n: t.float() for n, t in good["first_stage"].items()}},
            "residual of .* is torch.float32; residuals are torch.bfloat16")
    assert all(t.dtype == torch.bfloat16 for stage in ("first_stage", "second_stage") for t in good[stage].values())
    refused("residuals", "is a dict, got str")
    train(ddp, 1, rank, world_size)  # and the state still trains
    other.load_state_dict(good)
    same_dicts(other.state_dict(), good)


def _shared_and_reattached(rank, world_size):
    # One state shared by two models (register(..., state=st)), one backward each: both models' residuals, by name.
    da, st = trained(40, steps=1, rank=rank)
    db, _ = trained(40, steps=1, rank=rank, state=st)
    saved = st.state_dict()
    assert {"first.weight", "model1.first.weight"} <= set(saved["first_stage"]), sorted(saved["first_stage"])
    ea, fresh = trained(40, steps=0, rank=rank)
    trained(40, steps=0, rank=rank, state=fresh)  # registered in the same order: the same names
    fresh.load_state_dict(saved)
    same_dicts(fresh.state_dict(), saved)

    # A whole model saved with its hook, restored, reattached: one step, then its residuals save.
    buffer = io.BytesIO()
    torch.save(da, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    state = ddp_triton.reattach(restored)
    train(restored, 1, rank, world_size)
    assert set(state.state_dict()["first_stage"]) == {n for n, _ in restored.module.named_parameters()}


def _not_bound_yet(rank, world_size):
    _, state = trained(40, rank=rank)
    saved = state.state_dict()
    unbound = pickle.loads(pickle.dumps(state))  # a restored state binds at its first bucket
    assert unbound.context is None
    empty = unbound.state_dict()
    assert empty["first_stage"] == {} and empty["rank"] is None
    state.load_state_dict(empty)  # an empty dict of a state not bound yet loads anywhere
    unbound.name_parameters(Net(40))
    unbound.load_state_dict(saved)
    same_dicts(unbound.state_dict(), saved)  # what was loaded, with its rank, before binding


def _huge_gradient(rank, world_size):
    # One finite 1e30 gradient element on one rank, once, under FP8 with error feedback: each later step re-sends
    # what FP8 rounding left of it (at most 1/16 of it in E4M3), so the averaged gradients stay huge for a few steps,
    # and their norm's float32 sum of squares overflows to inf exactly where torch's norm of the same gradients does.
    model = Net(40)
    poke = {"on": rank == 0}

    def huge(grad):
        if poke["on"]:
            grad = grad.clone()
            grad.view(-1)[5] = 1e30
        return grad

    model.first.weight.register_hook(huge)
    ddp = DDP(model, bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, grad_stats=True, **FP8_EF)
    infinite = []
    for step in range(12):
        x, y = make_data(step)
        ddp.zero_grad()
        local_backward(ddp, x, y, rank, world_size)
        poke["on"] = False
        ours = state.grad_norm()
        theirs = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ddp.parameters()]))
        assert math.isinf(ours) == math.isinf(theirs), (step, float(ours), float(theirs))
        infinite.append(math.isinf(ours))
        assert not state.found_inf(), "every averaged gradient is finite"
    assert infinite[0] and not infinite[-1], infinite  # it decays by 16x or more a step
    assert sum(infinite) <= 10, infinite


def _checkpoint_worker(rank, world_size):
    for case in (_refusals, _shared_and_reattached, _not_bound_yet, _huge_gradient):
        case(rank, world_size)


def test_checkpoints_refuse_mismatches_and_serve_shared_reattached_and_unbound_states():
    torch_path_workers(_checkpoint_worker, 2)


def test_settings_are_checked_where_given():
    for bad, match in ((dict(grad_stats="no"), "grad_stats must be True or False, got 'no'"),
                       (dict(timing=1), "timing must be True or False, got 1"),
                       (dict(device="cuda:0"), "device must be None or a torch.device"),
                       (dict(comm_dtype=torch.float8_e4m3fn, accumulate_dtype=torch.bfloat16), "accumulate_dtype")):
        with pytest.raises(ValueError, match=match):
            ddp_triton.CommState(**bad)
        with pytest.raises(ValueError, match=match):
            check_options(bad)
    with pytest.raises(TypeError, match="unknown CommState options \\['bucket_cap_mb'\\]"):
        check_options(dict(bucket_cap_mb=25))
    with pytest.raises(TypeError, match="process_group must be None or a torch.distributed ProcessGroup"):
        check_options(dict(process_group="world"))
    assert check_options(dict(comm_dtype=torch.float8_e5m2)).name == "fp8e5m2+ef"
    assert copy.deepcopy(check_options({})).name == "bf16"
