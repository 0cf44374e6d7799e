"""A whole DDP training step with triton_hook captured in one CUDA graph, and what the state refuses under capture.

Tier: GPU (NCCL at world size 1, skipped without CUDA) for the capture itself, following torch's recipe for capturing
DDP (async error handling off before the group exists, DDP built on the capture stream, warm-up steps first); no
device for the refusals, where only the capture check is stood in for.
"""

import os
import tempfile
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_triton.runtime import telemetry

WARMUP = 11  # torch's recipe: at least 11 DDP-enabled eager steps before capture
STEPS = 5


@pytest.fixture
def nccl_for_capture(monkeypatch):
    """One NCCL rank with async error handling off, as torch's recipe for capturing DDP asks."""
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "0")  # the name before torch 2.2
    torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(comm_dtype=torch.bfloat16),
                                     dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)],
                         ids=["bf16", "bf16+fp32sum"])
def test_captured_step_replays_the_eager_steps_bits(nccl_for_capture, options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = [torch.randn(32, 64, device="cuda", generator=gen) for _ in range(WARMUP + STEPS)]
    with torch.cuda.stream(side):
        # several buckets, so the hook's per-bucket path runs more than once per step
        ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.1, gradient_as_bucket_view=True)
        state = ddp_triton.register(ddp, profile=None, **options)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        static_x = torch.zeros(32, 64, device="cuda")

        def step():
            opt.zero_grad(set_to_none=False)
            ddp(static_x).square().mean().backward()
            opt.step()

        for x in data[:WARMUP]:
            static_x.copy_(x)
            step()
        start = [p.detach().clone() for p in model.parameters()]
        eager = []
        for x in data[WARMUP:]:  # the eager steps with the hook, on the stream the graph is captured on
            static_x.copy_(x)
            step()
            eager.append([p.detach().clone() for p in model.parameters()])
        with torch.no_grad():
            for p, q in zip(model.parameters(), start):
                p.copy_(q)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    buckets = len(state.plans)
    assert buckets > 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    assert len(state.plans) == buckets, "nothing bound during capture"
    for i, (x, expected) in enumerate(zip(data[WARMUP:], eager)):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        for (name, p), q in zip(model.named_parameters(), expected):
            assert torch.equal(p.detach().view(torch.int32), q.view(torch.int32)), f"{name} differs at replay {i}"


@pytest.mark.gpu
def test_a_bucket_first_seen_under_capture_is_refused(nccl_for_capture):
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ddp = DDP(nn.Linear(64, 64).cuda(), device_ids=[0])
        ddp_triton.register(ddp, profile=None)
        x = torch.randn(8, 64, device="cuda")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="first seen during CUDA graph capture"):
        with torch.cuda.graph(graph, stream=side):
            ddp(x).sum().backward()


def test_binding_and_timing_under_capture_are_refused_with_a_reason():
    """What the state checks where a capture could start (the capture check stood in for, no device needed)."""
    cuda_buffer = SimpleNamespace(is_cuda=True)
    state = ddp_triton.CommState(profile=None, timing=True)  # no process group: unbound, binds at a first bucket
    with mock.patch("torch.cuda.is_current_stream_capturing", return_value=True):
        with pytest.raises(RuntimeError, match="first seen during CUDA graph capture.*at least 11"):
            state.plan_for(cuda_buffer, None)
        with pytest.raises(RuntimeError, match="timing=True.*CUDA graph"):
            telemetry.watch(True, SimpleNamespace(buffer=cuda_buffer))
        assert telemetry.watch(False, SimpleNamespace(buffer=cuda_buffer)) is None  # no timing: the plain path
    assert not state.bound and state.plans == {}
