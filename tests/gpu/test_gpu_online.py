"""Online tuning on a GPU: after its choice, no step makes the host wait for the device (DDP over NCCL at world size 1).

Tier: GPU (skipped without CUDA). The steady state's checks (every ``CHECK_EVERY`` steps: the window's median step
all-reduced, read at the next check) run under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any copy
or call that synchronises the host with the device; ``Event.synchronize``, which it does not watch, is watched here on
the tuner's own events. The same promise without a GPU, with a recorder standing in for the CUDA calls:
tests/unit/runtime/test_online_host_syncs.py.
"""

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_triton.runtime import online

pytestmark = pytest.mark.gpu


def test_online_tuning_after_its_choice_never_makes_the_host_wait(nccl_world_of_one, monkeypatch):
    monkeypatch.setattr(online, "CHECK_EVERY", 3)  # more checks, each read at the next, in fewer steps
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.01)
    state = ddp_triton.register(ddp, comm_dtype="auto", tune="online", profile=None, formats=["fp32", "bf16"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        opt.step()

    steps = 0
    while state.tuned_formats() is None:  # tuning: its timed steps wait for their events and all-reduce, as said
        step()
        steps += 1
        assert steps <= 1 + len(online.uniform_rounds(2)) + 1 + online.ROUNDS * online.MEASURED_PASSES + 1
    for _ in range(2):  # the chosen formats bind their plans at their first step
        step()
    torch.cuda.synchronize()

    waited = []
    synchronize = torch.cuda.Event.synchronize

    def watched(event):
        if not event.query():
            waited.append(event)
        return synchronize(event)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", watched)
    checks_before = state.tuner._baseline
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5 * online.CHECK_EVERY):  # five checks, four of them reading the one before
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    # A model this small keeps the GPU ahead of the host, so every check's result is back by the next.
    assert waited == [] and state.tuner.late_checks == 0
    assert checks_before is None and state.tuner._baseline is not None and state.tuner._baseline > 0.0  # read
    assert state.tuner.tunings == 1
