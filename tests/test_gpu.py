"""The compiled path end to end on one GPU: the bound launch, and triton_hook under DDP over NCCL at world size 1.

Tier: GPU (skipped without CUDA). Kernel bit-exactness on CUDA is in test_kernels.py.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from bits import assert_same_bits, reference_pack
from ddp_triton.kernels import bind_pack, launch

pytestmark = pytest.mark.gpu


def test_bound_launch_takes_the_direct_path_and_agrees():
    grads = [torch.randn(n, device="cuda") for n in (5000, 17, 70000)]
    out = torch.empty(75017, dtype=torch.bfloat16, device="cuda")
    again = bind_pack(grads, out, 0.25)
    assert launch._direct_launch_ok, "the direct launch failed its self-check on this Triton version"
    assert again._direct is not None
    for g in grads:
        g.mul_(-2)
    again()
    assert_same_bits(out, reference_pack([g.cpu() for g in grads], torch.bfloat16, 0.25))


@pytest.fixture
def nccl_world_of_one():
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("gabv", [False, True])
def test_triton_hook_over_nccl(nccl_world_of_one, gabv):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    reference = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    reference.load_state_dict(model.state_dict())
    ddp = DDP(model, device_ids=[0], gradient_as_bucket_view=gabv, bucket_cap_mb=0.01)
    state = ddp_triton.register(ddp, comm_dtype=torch.bfloat16, profile=None)
    x = torch.randn(32, 64, device="cuda")
    for _ in range(3):  # the third step runs on the buckets DDP rebuilt after the first
        ddp.zero_grad()
        reference.zero_grad()
        ddp(x).square().mean().backward()
        reference(x).square().mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        # world size 1: the hook's result is the gradient rounded once to bfloat16
        assert_same_bits(p.grad, q.grad.to(torch.bfloat16).float())
    assert len(state.buckets) >= 2


def test_plain_pack_reuses_its_direct_launch():
    from ddp_triton.kernels import pack

    grads = [torch.randn(n, device="cuda") for n in (4096, 300)]
    out = torch.empty(4396, dtype=torch.bfloat16, device="cuda")
    pack(grads, out, 0.5)
    entries = len(launch.ONE_SHOT._entries)
    for g in grads:
        g.mul_(3)
    pack(grads, out, 0.5)  # same memory and layout: the cached direct launch, no new entry
    assert len(launch.ONE_SHOT._entries) == entries
    assert_same_bits(out, reference_pack([g.cpu() for g in grads], torch.bfloat16, 0.5))
