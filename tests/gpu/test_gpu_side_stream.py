"""The staged exchanges over NCCL never make the backward's stream wait for a collective: read from CUDA's own trace.

Tier: GPU (skipped without CUDA), NCCL at world size 1 in one worker process (``dist_utils``). At one rank the
formats summed in float32 still stage (all-to-all, then all-gather: ``WireFormat.one_all_reduce`` is for two ranks
only), so the hook issues staged collectives on one GPU. A two-level format goes flat at one node, so the worker
hands its state a two-level context by hand: one node of one rank, the node, cross and gather groups each a group of
this one rank, so the hook issues the reduce-scatter, the cross exchange and the all-gather of a two-level bucket.
World size 2 on one GPU cannot be had with NCCL (one rank per GPU); tests/gpu/test_gpu_ranks.py runs several ranks
on one GPU over gloo instead.

What is read: torch's GPU trace (the CUDA sanitizer's hooks, ``torch.cuda._gpu_trace``), which names the stream of
every event record and every event wait torch enqueues, a CUDA future's ``wait`` included (torch's profiler does not
name the waiting stream in its trace without experimental settings). The worker wraps the hook: while a hook call
runs, nothing may make the stream that called it (the backward's) wait for anything, and the waits the exchange
needs must be there, on other streams (its side stream and the completions' pool streams). NCCL completes a
collective's future at launch, so everything the hook enqueues for a bucket it enqueues inside the call; the backward's
next kernel follows on that stream unhindered. The trace is switched on in the worker only (it stays on for the rest
of a process's life). Each case also checks the gradients: the bits of the 16-bit formats summed in float32 (at one
rank, the gradient rounded once to bfloat16), and finite FP8 and E2M1 results, so a missing order between streams
shows; and, every pass measuring it here, the rounding the block-scaled buckets report in ``summary()``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_utils import run_workers

pytestmark = pytest.mark.gpu

WARMUP = 2  # the buckets bind at the first step and again after DDP's rebuild at the second
TRACED = 2  # steps traced, on the rebuilt buckets
CHUNK_BYTES = 64 << 10  # about four chunks per bucket of one 256 x 256 layer (263 KB)

CASES = {  # name: (register's options, two-level format name or None, bytes per chunk or None)
    "bf16+fp32sum": (dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32), None, None),
    "fp8e4m3+ef": (dict(comm_dtype=torch.float8_e4m3fn), None, None),
    "fp8e4m3+ef chunks": (dict(comm_dtype=torch.float8_e4m3fn), None, CHUNK_BYTES),
    "two-level bf16+fp32sum": (dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32),
                               "two-level bf16+fp32sum", None),
    "two-level bf16+fp32sum chunks": (dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32),
                                      "two-level bf16+fp32sum", CHUNK_BYTES),
    "two-level fp8e4m3+ef chunks": (dict(comm_dtype=torch.float8_e4m3fn), "two-level fp8e4m3+ef", CHUNK_BYTES),
    "fp4e2m1+ef chunks": (dict(comm_dtype="fp4e2m1+ef"), None, CHUNK_BYTES),
    "two-level fp4e2m1+ef": (dict(comm_dtype="fp4e2m1+ef"), "two-level fp4e2m1+ef", None),
}


def _layers():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4))).cuda()


def _case(name, trace):
    """One case: DDP with the hook in the case's format, warmed up, then traced; its problems (empty: none)."""
    import ddp_triton
    from ddp_triton.formats import WireFormat
    from ddp_triton.runtime.exchange import ChunkedExchange
    from ddp_triton.runtime.nodes import NodeGroups

    options, two_level, chunk_bytes = CASES[name]
    model, reference = _layers(), _layers()
    ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.3)  # one layer a bucket: four buckets
    state = ddp_triton.register(ddp, profile=None, **options)
    replaced = {}
    if two_level is not None:  # one node of one rank: a group of its own for each of the three
        groups = [dist.new_group([0]) for _ in range(3)]
        replaced.update(wire=WireFormat.parse(two_level), nodes=NodeGroups(1, 1, 0, 0, *groups))
    if chunk_bytes is not None:
        replaced.update(chunk_bytes=chunk_bytes)
    state.context = dataclasses.replace(state.context, **replaced)
    x = torch.randn(32, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    problems = []
    for step in range(WARMUP + TRACED):
        traced = step >= WARMUP
        trace.on = traced
        ddp.zero_grad()
        reference.zero_grad()
        ddp(x).square().mean().backward()
        trace.on = False
        torch.cuda.synchronize()
        reference(x).square().mean().backward()
        for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
            if "fp32sum" in name:
                if not torch.equal(p.grad, q.grad.to(torch.bfloat16).float()):
                    problems.append(f"step {step}: {pname}'s gradient is not the reference's bits")
            elif not (torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0):
                problems.append(f"step {step}: {pname}'s gradient is not finite or all zero")
    if state.context.wire.block_scaled:  # every pass measured its rounding (ROUNDING_EVERY = 1), traced ones too
        rounded = [b.rounding_error for b in state.summary().buckets]
        if not all(r is not None and 0 < r < 0.2 for r in rounded):
            problems.append(f"the buckets' measured rounding: {rounded}, expected each in (0, 0.2)")
    if two_level is not None and state.context.wire.name != two_level:
        problems.append(f"the state runs {state.context.wire.name}, not {two_level}")
    chunked = [isinstance(plan.exchange, ChunkedExchange) for plan in state.plans.values()]
    if any(chunked) != (chunk_bytes is not None):
        problems.append(f"chunked buckets: {chunked}, expected {'some' if chunk_bytes else 'none'}")
    if trace.hooks < TRACED * 2:
        problems.append(f"{trace.hooks} hook calls traced in {TRACED} steps: expected several buckets a step")
    if trace.compute_waits:
        problems.append(f"the backward's stream waited {len(trace.compute_waits)} times inside the hook "
                        f"(stream {trace.compute_waits[0]})")
    if not trace.other_waits:
        problems.append("no stream waited for anything inside the hook: the trace recorded nothing")
    return problems


class _Trace:
    """What the GPU trace saw while a hook call ran, in steps where ``on``."""

    def __init__(self):
        self.on, self.stream, self.hooks = False, None, 0
        self.compute_waits, self.other_waits = [], []

    def wrap(self, hook):
        def traced_hook(state, bucket):
            if not self.on:
                return hook(state, bucket)
            self.stream, self.hooks = torch.cuda.current_stream().cuda_stream, self.hooks + 1
            try:
                return hook(state, bucket)
            finally:
                self.stream = None
        return traced_hook

    def event_wait(self, event, stream):
        if self.stream is not None:
            (self.compute_waits if stream == self.stream else self.other_waits).append(stream)


def _worker(rank, world_size, names):
    from torch.cuda import _gpu_trace
    from ddp_triton.runtime import hook as hook_module, telemetry

    telemetry.ROUNDING_EVERY = 1  # the block-scaled buckets measure their rounding in the traced steps too
    torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    trace = _Trace()
    hook_module.triton_hook = trace.wrap(hook_module.triton_hook)  # register() registers the module's hook
    torch._C._activate_gpu_trace()
    _gpu_trace.register_callback_for_event_wait(trace.event_wait)
    failures = []
    for name in names:
        trace.hooks, trace.compute_waits, trace.other_waits = 0, [], []
        failures += [f"{name}: {problem}" for problem in _case(name, trace)]
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_backward_stream_never_waits_inside_the_hook():
    """Every case in one worker (one CUDA context, one set of kernel compiles): 20-40 s expected."""
    run_workers(_worker, 1, list(CASES), timeout=100.0, init=False)
