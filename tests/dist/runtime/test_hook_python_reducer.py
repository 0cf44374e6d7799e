"""triton_hook called the way DDP's Python reducer calls it: once per parameter, with ``(param.grad, param)``.

Tier: gloo multi-process on CPU (world size 2, spawned here), kernels on their torch CPU path. The compiled test
runs the real thing, ``optimize_ddp = "python_reducer"`` with compiled autograd (backend aot_eager: the traced
graph runs the same aten ops eagerly, no C++ compiler needed); the eager test calls the hook with the tuple
directly. The reference is the same hook on DDP's buckets, eagerly, on the same data: equal bits are expected,
because each path scales in float32, rounds once to the comm dtype, sums two values (one addition, whatever the
order) and scales back. At world size 4 gloo may add four values in another order per path, so only 2 is exact.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from bits import assert_same_bits
from ddp_helpers import local_backward, local_slice, make_data, make_model, torch_path_workers

WORLD = 2


def _eager_bucket_grads(hook_state, rank, world_size, step=0, dtype=torch.float32):
    """The gradients the bucket path gives: DDP with triton_hook, eagerly, several buckets."""
    model = make_model(dtype=dtype)
    ddp = DDP(model, bucket_cap_mb=0.002)
    ddp.register_comm_hook(hook_state, ddp_triton.triton_hook)
    x, y = make_data(step, dtype)
    local_backward(ddp, x, y, rank, world_size)
    return [p.grad.clone() for p in model.parameters()]


def _tuple_call_worker(rank, world_size):
    from ddp_triton.runtime.state import CommState

    states = {
        "bfloat16": lambda: CommState(comm_dtype=torch.bfloat16, profile=None),
        "float16": lambda: CommState(comm_dtype=torch.float16, profile=None),
        "float32": lambda: CommState(comm_dtype=torch.float32, profile=None),
        "None": lambda: None,
        "group": lambda: dist.group.WORLD,
    }
    for name, make_state in states.items():
        for dtype in (torch.float32, torch.bfloat16):
            expected = _eager_bucket_grads(make_state(), rank, world_size, dtype=dtype)
            model = make_model(dtype=dtype)  # no DDP: this rank's own gradient, then the hook per parameter
            x, y = make_data(0, dtype)
            local_backward(model, x, y, rank, world_size)
            state = make_state()
            for p, want in zip(model.parameters(), expected):
                done = ddp_triton.triton_hook(state, (p.grad, p))
                assert isinstance(done, torch.futures.Future) and done.value() is p.grad
                try:
                    assert_same_bits(p.grad, want)
                except AssertionError as exc:
                    raise AssertionError(f"state {name}, {dtype}: {exc}") from None
            if isinstance(state, CommState):
                assert state.plans == {}, "the tuple path binds no bucket"
    # what the bucket path refuses, the tuple path refuses too
    grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        ddp_triton.triton_hook(None, (grad, grad))
    sparse = torch.ones(3).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        ddp_triton.triton_hook(None, (sparse, sparse))


def test_grad_param_tuple_gives_the_bucket_paths_bits():
    torch_path_workers(_tuple_call_worker, WORLD)


def _attach_hook(ddp, which):
    """A CommState of its own with float16 on the wire (post-scale 1/2 at N = 2), or None as torch's hooks take."""
    if which == "register-float16":
        return ddp_triton.register(ddp, comm_dtype=torch.float16)
    ddp.register_comm_hook(None, ddp_triton.triton_hook)
    return None


def _compiled_autograd_worker(rank, world_size, which):
    from torch._dynamo.utils import counters

    # The eager reference first: DDP reads optimize_ddp when it is built.
    expected_model = make_model()
    eager = DDP(expected_model, bucket_cap_mb=0.002)
    eager_state = _attach_hook(eager, which)

    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch._dynamo.config.compiled_autograd = True
    compiled_model = make_model()
    ddp = DDP(compiled_model)
    assert ddp._use_python_reducer and not eager._use_python_reducer
    state = _attach_hook(ddp, which)

    @torch.compile(backend="aot_eager")
    def forward_backward(x, y):
        nn.functional.mse_loss(ddp(x), y).backward()

    for step in range(2):
        x, y = make_data(step)
        xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        eager.zero_grad()
        ddp.zero_grad()
        nn.functional.mse_loss(eager(xs), ys).backward()
        forward_backward(xs, ys)
        for (name, p), q in zip(expected_model.named_parameters(), compiled_model.parameters()):
            try:
                assert_same_bits(q.grad, p.grad)
            except AssertionError as exc:
                raise AssertionError(f"step {step}, {name}: {exc}") from None
        with torch.no_grad():
            for p, q in zip(expected_model.parameters(), compiled_model.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
    assert counters["compiled_autograd"]["captures"] >= 1, "the backward did not go through compiled autograd"
    if state is not None:
        assert state.plans == {} and eager_state.plans, "compiled: the per-parameter path; eager: buckets"


@pytest.mark.parametrize("which", ["register-float16", "None"])
def test_compiled_autograd_python_reducer_matches_eager_bits(which):
    torch_path_workers(_compiled_autograd_worker, WORLD, which)
