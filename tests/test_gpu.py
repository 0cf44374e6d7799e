"""The compiled path on one GPU: kernel bits on CUDA, the bound launch, and triton_hook under DDP over NCCL at world
size 1.

Tier: GPU (skipped without CUDA). The same kernels' bits in Triton's interpreter are in test_kernels.py.
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
from ddp_triton.kernels import bind_pack, bind_unpack, launch, pack, unpack
from test_kernels import DTYPE_IDS, DTYPES, EDGE_FLOAT32, random_bit_patterns

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
    assert all(e.pack._direct is not None and e.unpack._direct is not None for e in state.buckets.values())


def test_triton_hook_scaled_kernels_over_nccl(nccl_world_of_one):
    """At world size 1 the division is 1: force factors so the hook runs the scaled kernels it runs at N > 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    reference = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    reference.load_state_dict(model.state_dict())
    ddp = DDP(model, device_ids=[0], gradient_as_bucket_view=True)
    state = ddp_triton.register(ddp, comm_dtype=torch.float16, profile=None)
    state.pre_scale, state.post_scale = 0.25, 4.0  # as the float16 split would be at world size 16
    x = torch.randn(32, 64, device="cuda")
    ddp(x).square().mean().backward()
    reference(x).square().mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_same_bits(p.grad, q.grad.mul(0.25).to(torch.float16).float().mul(4.0))


def test_plain_pack_reuses_its_direct_launch():
    grads = [torch.randn(n, device="cuda") for n in (4096, 300)]
    out = torch.empty(4396, dtype=torch.bfloat16, device="cuda")
    pack(grads, out, 0.5)
    entries = len(launch.ONE_SHOT._entries)
    assert entries >= 1, "plain pack() did not take the direct launch"
    for g in grads:
        g.mul_(3)
    pack(grads, out, 0.5)  # same memory and layout: the cached direct launch, no new entry
    assert len(launch.ONE_SHOT._entries) == entries
    assert_same_bits(out, reference_pack([g.cpu() for g in grads], torch.bfloat16, 0.5))


@pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("src_dtype", DTYPES, ids=DTYPE_IDS)
def test_compiled_kernel_bits_on_cuda(src_dtype, out_dtype):
    tensors = [random_bit_patterns(n, src_dtype, seed=n).cuda() for n in (1, 4097, 100_003)]
    tensors.append(EDGE_FLOAT32.to(src_dtype).cuda())
    for scale in (1.0, 1 / 8, 1 / 3, 3.0):
        out = torch.empty(sum(t.numel() for t in tensors), dtype=out_dtype, device="cuda")
        pack(tensors, out, scale)
        expected = reference_pack([t.cpu() for t in tensors], out_dtype, scale)
        assert_same_bits(out, expected)
        back = [torch.empty_like(t) for t in tensors]
        bind_unpack(out, back, 1 / scale)()
        assert_same_bits(torch.cat(back), out.cpu().float().mul(1 / scale).to(src_dtype))


@pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
def test_compiled_contiguous_kernel_scaled_on_cuda(out_dtype):
    """The hook's own case: one aligned bucket, scaled, full vector blocks plus a tail, every bit pattern."""
    bucket = torch.cat([EDGE_FLOAT32, random_bit_patterns(3 * 4096 + 977 - EDGE_FLOAT32.numel(), torch.float32)])
    bucket = bucket.cuda()
    for scale in (1 / 8, 1 / 3, 0.5):
        comm = torch.empty(bucket.numel(), dtype=out_dtype, device="cuda")
        bind_pack([bucket], comm, scale)()
        assert_same_bits(comm, reference_pack([bucket.cpu()], out_dtype, scale))
        back = torch.empty_like(bucket)
        stats = torch.zeros(2, device="cuda")
        unpack(comm, [back], 2.0, stats=stats)
        expected = comm.cpu().float().mul(2.0)
        assert_same_bits(back, expected)
        assert int(stats[1]) == int((~torch.isfinite(expected)).sum())


def test_more_than_2_to_the_31_elements_on_cuda():
    free, _ = torch.cuda.mem_get_info()
    n = 2**31 + 1000
    if free < n * 6 + (1 << 30):
        pytest.skip("not enough GPU memory")
    src = torch.ones(n, dtype=torch.float32, device="cuda")
    src[-1000:] = 3.0
    out = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    pack([src], out, 0.5)
    assert out[-1].item() == 1.5 and out[0].item() == 0.5 and out[2**31].item() == 0.5
    del src, out
    torch.cuda.empty_cache()
