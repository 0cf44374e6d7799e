"""Online tuning (``tune="online"``): every rank tries the same formats at the same steps and makes the same choice.

Tier: gloo multi-process on CPU, on the kernels' torch path. Ranks sleep for random times of their own before their
backward (stragglers), so their own timings differ; the choice must not. The residual test gives each step a
gradient that does not depend on the weights, so that what SGD applied over the run can be compared with the true
mean gradients: error feedback's residuals must reach the weights when a bucket leaves FP8. A rank killed mid-tuning
is part of ``test_failures.py``'s survivors test (its ``online`` case).
"""

import logging
import os
import random
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_helpers import local_backward, make_data, make_model, torch_path_workers
from ddp_triton import log as log_module
from ddp_triton.dtypes import normalize_dtype
from ddp_triton.formats import WireFormat
from ddp_triton.machine.profile import ddp_kwargs, load_profile
from ddp_triton.runtime import online

FOUR = ["fp32", "bf16", "bf16+fp32sum", "fp8e4m3+ef"]
ONLINE = dict(comm_dtype="auto", tune="online", profile=None)


def _wide_model():
    return make_model(widths=(8, 64, 64, 64, 4))  # with bucket_cap_mb=0.01: three buckets


def _short_rounds():
    """Two rounds of a warm and a timed pass per format: every part of the schedule, in fewer steps."""
    online.WARM_PASSES, online.MEASURED_PASSES, online.ROUNDS = 1, 1, 2


def _decided_at(n_formats, mixed=True, start=1):
    """The pass at whose first bucket a tuning of ``n_formats`` that starts at pass ``start`` decides, with the mix's
    trial when ``mixed`` (at most that pass: the mix is tried only where the buckets' fastest formats differ)."""
    mix = online.WARM_PASSES + online.ROUNDS * online.MEASURED_PASSES if mixed else 0
    return start + len(online.uniform_rounds(n_formats)) + mix


def _train(ddp, rank, world_size, steps, first=0, straggle=0.0, seed=0):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    sleeps = random.Random(seed * 100 + rank)
    for step in range(first, first + steps):
        if straggle:
            time.sleep(sleeps.uniform(0.0, straggle))
        opt.zero_grad()
        x, y = make_data(step)
        local_backward(ddp, x, y, rank, world_size)
        opt.step()


def _gathered(value, world_size):
    out = [None] * world_size
    dist.all_gather_object(out, value)
    return out


def _stragglers_worker(rank, world_size):
    ddp = DDP(_wide_model(), bucket_cap_mb=0.01)
    state = ddp_triton.register(ddp, formats=FOUR, **ONLINE)
    uniform_trials_end = _decided_at(len(FOUR), mixed=False)  # the pass at whose first bucket the rounds are in
    last_trial_ends = _decided_at(len(FOUR))  # and their mix, if it is tried
    _train(ddp, rank, world_size, uniform_trials_end, straggle=0.02, seed=1)
    assert state.tuned_formats() is None  # still tuning
    _train(ddp, rank, world_size, last_trial_ends + 1 - uniform_trials_end, first=uniform_trials_end)
    assert state.passes == last_trial_ends + 1 <= 39  # four rounds of four formats, a warm and a timed pass each
    tuned = state.tuned_formats()
    assert tuned is not None and len(tuned) >= 2, tuned
    assert all(entry["format"] in FOUR and set(entry["step_ms"]) >= set(FOUR) for entry in tuned.values())
    assert len({repr(t) for t in _gathered(tuned, world_size)}) == 1  # the same choice and times on every rank
    # Every bucket now binds in its chosen format, and the replicas stayed identical throughout.
    _train(ddp, rank, world_size, 2, first=last_trial_ends + 1)
    plans = state.latest_pass()
    assert sorted(p.record.wire_format for p in plans) == sorted(
        telemetry_name(tuned[p.record.index]["format"]) for p in plans)
    params = torch.cat([p.detach().view(-1) for p in ddp.parameters()])
    assert len({params.numpy().tobytes() for params in _gathered(params, world_size)}) == 1


def telemetry_name(name):
    """How the telemetry names a bucket sent in format ``name``: an all-reduce by its dtype."""
    wire = WireFormat.parse(name)
    return name if wire.sharded else normalize_dtype(wire.comm_dtype)


def test_every_rank_tries_the_same_formats_and_chooses_alike_under_stragglers():
    torch_path_workers(_stragglers_worker, 3, timeout=240)


class _Linear(nn.Module):
    """loss = sum(w * x): the gradient is x, whatever w is."""

    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return (self.w * x).sum()


#: Three rounds of fp32 and FP8 + EF, a warm and a timed pass each (in alternating order), from pass 1: the bucket
#: goes into FP8 twice and leaves it in between, then the decision at pass 13.
SWITCHING = ["fp32", "fp32", "fp8", "fp8", "fp8", "fp8", "fp32", "fp32", "fp32", "fp32", "fp8", "fp8"]


def _switching_steps(model, rank, world_size, n, wire_now, steps=15):
    """``steps`` SGD steps (lr 1) of ``_Linear`` on each rank's own input: the sum of the averaged gradients, which
    is what the steps should have applied, and the wire format (``wire_now()``) after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    truth = torch.zeros(n, dtype=torch.float64)
    seen = []
    for step in range(steps):
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(10 * step + r)) * (1 + r) for r in
              range(world_size)]
        truth += torch.stack(xs).double().mean(0)
        opt.zero_grad()
        model(xs[rank]).backward()
        opt.step()
        seen.append(wire_now())
    return truth, seen


def _residual_worker(rank, world_size, final):
    online.WARM_PASSES, online.MEASURED_PASSES, online.ROUNDS = 1, 1, 3
    online.choose_within_noise = lambda samples: (final, 0.0)  # the test's choice
    n = 3000
    ddp = DDP(_Linear(n), bucket_cap_mb=25)
    state = ddp_triton.register(ddp, formats=["fp32", "fp8e4m3+ef"], **ONLINE)
    names = {"fp32": telemetry_name("fp32"), "fp8": telemetry_name("fp8e4m3+ef")}
    truth, seen = _switching_steps(ddp, rank, world_size, n, lambda: state.latest_pass()[0].record.wire_format)
    # The rounds, then the decision (the mix is never tried: one format is every bucket's fastest)
    assert seen[1:13] == [names[s] for s in SWITCHING] and seen[13:] == [telemetry_name(final)] * 2, seen
    applied = -ddp.module.w.detach().double()
    residual = state.state_dict()["first_stage"]
    if final == "fp32":  # the residuals went into the first fp32 exchange: nothing is owed, nothing was lost but
        # bfloat16's rounding of what was owed (to 2^-8 of it at each store; 4.6e-4 at most here), where a residual
        # dropped would be FP8's rounding itself (about 2^-4 of a gradient: 1e-2 to 1e-1 here)
        assert not residual or all(float(v.abs().max()) == 0.0 for v in residual.values())
        torch.testing.assert_close(applied, truth, rtol=0, atol=2e-3)
    else:  # still in FP8: what is applied plus what is owed is the truth
        assert (applied - truth).abs().max() > 1e-4  # FP8's rounding is there to be owed
    fp8_error = 0.05 * float(truth.abs().max())
    assert float((applied - truth).abs().max()) < fp8_error


@pytest.mark.parametrize("final", ["fp32", "fp8e4m3+ef"])
def test_a_bucket_leaving_fp8_hands_its_residuals_to_its_next_exchange(final):
    torch_path_workers(_residual_worker, 2, final, timeout=180)


def _resume_worker(rank, world_size, tmp):
    _short_rounds()
    ddp = DDP(_wide_model(), bucket_cap_mb=0.01)
    state = ddp_triton.register(ddp, formats=["fp32", "bf16"], **ONLINE)
    _train(ddp, rank, world_size, _decided_at(2) + 1)  # two formats and, at most, their mix
    tuned = state.tuned_formats()
    assert tuned is not None
    saved = state.state_dict()
    assert saved["online"]["buckets"]
    path = os.path.join(tmp, "profile.json")
    if rank == 0:
        state.save_profile(path)
    dist.barrier()

    # A resumed job: the same model and buckets, the checkpoint's choice, no tuning at all.
    resumed = DDP(_wide_model(), bucket_cap_mb=0.01)
    again = ddp_triton.register(resumed, formats=["fp32", "bf16"], **ONLINE)
    again.load_state_dict(saved)
    assert again.tuned_formats() == tuned
    _train(resumed, rank, world_size, 4)
    assert again.tuner.tunings == 0 and again.tuned_formats() == tuned
    formats = {p.record.index: p.record.wire_format for p in again.latest_pass()}
    assert formats == {i: telemetry_name(entry["format"]) for i, entry in tuned.items()}

    # Other buckets (DDP regrouped the parameters): the checkpoint's choice does not hold; the job tunes again.
    other = DDP(_wide_model(), bucket_cap_mb=25)
    third = ddp_triton.register(other, formats=["fp32", "bf16"], **ONLINE)
    third.load_state_dict(saved)
    _train(other, rank, world_size, 3)
    assert third.tuned_formats() is None  # tuning again, from pass 2 (one bucket: no mix)
    _train(other, rank, world_size, _decided_at(2, mixed=False, start=2) + 1 - 3, first=3)
    assert third.tuner.tunings == 1 and len(third.tuned_formats()) == 1

    # The profile it wrote gives comm_dtype="auto" each bucket size's chosen format.
    profile = load_profile(path)
    assert sorted(profile.formats.admitted) == ["bf16", "fp32"]
    for entry in tuned.values():
        assert profile.format_for(entry["elements"] * 4) == entry["format"]
    followed = DDP(_wide_model(), bucket_cap_mb=0.01)
    follower = ddp_triton.register(followed, comm_dtype="auto", profile=path)
    _train(followed, rank, world_size, 3)
    assert {p.record.index: p.record.wire_format for p in follower.latest_pass()} == formats


def test_a_resumed_job_keeps_the_choice_and_skips_tuning(tmp_path):
    torch_path_workers(_resume_worker, 2, str(tmp_path), timeout=240)


def _saved_profile_worker(rank, world_size, tmp):
    _short_rounds()
    ddp = DDP(_wide_model(), bucket_cap_mb=0.01)
    state = ddp_triton.register(ddp, formats=["fp32", "bf16"], **ONLINE)
    _train(ddp, rank, world_size, _decided_at(2) + 1)  # two formats and, at most, their mix
    tuned = state.tuned_formats()
    assert tuned is not None
    path = os.path.join(tmp, "online.json")
    if rank == 0:
        state.save_profile(path)
    dist.barrier()

    # The profile says what made it: this job's own steps, on its DDP buckets and world size.
    profile = load_profile(path)
    assert profile.source == "online", profile.summary()
    assert profile.bucket_cap_mb == 0.01 and "online" in profile.bucket_reason, profile.summary()
    assert ddp_kwargs(profile) == {"bucket_cap_mb": 0.01}
    assert (profile.world_size, profile.nodes, profile.backend) == (world_size, 1, "gloo"), profile.summary()

    # Loaded back into the same job it binds and trains without a word of warning.
    log_module._reset_warn_once()
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log_module.logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            followed = DDP(_wide_model(), **ddp_kwargs(profile))
            follower = ddp_triton.register(followed, comm_dtype="auto", profile=path)
            _train(followed, rank, world_size, 3)
    finally:
        log_module.logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []
    assert [str(w.message) for w in caught if "ddp_triton" in w.filename] == []
    assert {p.record.index: p.record.wire_format for p in follower.latest_pass()} == {
        i: telemetry_name(entry["format"]) for i, entry in tuned.items()}


def test_a_saved_online_choice_describes_its_job_and_loads_back_without_a_warning(tmp_path):
    torch_path_workers(_saved_profile_worker, 2, str(tmp_path), timeout=240)


def _drift_worker(rank, world_size):
    _short_rounds()
    online.CHECK_EVERY, online.DRIFT_CHECKS, online.RETUNE_SPACING = 3, 2, 10
    ddp = DDP(_wide_model(), bucket_cap_mb=25)
    state = ddp_triton.register(ddp, formats=["fp32", "bf16"], **ONLINE)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    tuned_at = []
    for step in range(60):
        # The step slows down by 60 ms from step 25 on: as a link shared with another job looks from here.
        time.sleep(0.01 if step < 25 else 0.07)
        opt.zero_grad()
        x, y = make_data(step)
        local_backward(ddp, x, y, rank, world_size)
        opt.step()
        tuned_at.append(state.tuner.tunings)
    first = tuned_at.index(1)
    assert first <= _decided_at(2, mixed=False), tuned_at  # one bucket: no mix
    assert tuned_at[24] == 1, tuned_at  # steady while the step is
    assert tuned_at[-1] == 2, tuned_at  # the slower step set off one re-tune, and one only
    second = tuned_at.index(2)
    assert second >= first + online.RETUNE_SPACING, tuned_at


def test_a_step_that_drifts_sets_off_one_re_tune():
    torch_path_workers(_drift_worker, 2, timeout=240)


# ---- FSDP2: each FSDP group's reduce-scatter in the format the job's steps chose --------------------------------


def _fsdp_shard(model, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for module in [*model.children(), model]:
        if any(True for _ in module.parameters()):
            fully_shard(module, mesh=mesh)
    return model


def _fsdp_worker(rank, world_size):
    import ddp_triton.fsdp

    _short_rounds()
    model = _fsdp_shard(_wide_model(), world_size)
    state = ddp_triton.fsdp.register(model, comm_dtype="auto", tune="online",
                                     formats=["fp32", "bf16+fp32sum", "fp8e4m3+ef"])
    assert state.wire is None and state.wire_setting == "auto"
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sleeps = random.Random(rank)
    tuned_at, losses = None, []
    for step in range(_decided_at(3) + 2):  # three formats and, at most, their mix
        time.sleep(sleeps.uniform(0.0, 0.01))
        opt.zero_grad()
        x, y = make_data(step)
        loss = nn.functional.mse_loss(model(x[rank::world_size]), y[rank::world_size])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if tuned_at is None and state.tuned_formats() is not None:
            tuned_at = step
    tuned = state.tuned_formats()
    assert tuned is not None and tuned_at <= _decided_at(3), tuned_at
    called = [i for i, c in enumerate(state.comms) if c.calls]  # the root holds no parameters of its own here
    assert sorted(tuned) == called and len(called) >= 3, (sorted(tuned), called)
    assert all(t["format"] in ("fp32", "bf16+fp32sum", "fp8e4m3+ef") for t in tuned.values())
    assert len({repr(t) for t in _gathered(tuned, world_size)}) == 1
    assert [state.comms[i].current.wire.name for i in called] == [tuned[i]["format"] for i in called]
    # A resumed job keeps the choice: the saved state names it, and a state loaded with it tunes no more.
    saved = state.state_dict()
    again = ddp_triton.fsdp.register(_fsdp_shard(_wide_model(), world_size), comm_dtype="auto", tune="online",
                                     formats=["fp32", "bf16+fp32sum", "fp8e4m3+ef"])
    again.load_state_dict(saved)
    assert again.tuned_formats() == tuned


def test_fsdp_groups_choose_their_formats_alike_on_every_rank():
    torch_path_workers(_fsdp_worker, 2, timeout=240)


def _fsdp_residual_worker(rank, world_size):
    import ddp_triton.fsdp

    online.WARM_PASSES, online.MEASURED_PASSES, online.ROUNDS = 1, 1, 3
    online.choose_within_noise = lambda samples: ("fp32", 0.0)  # the test's choice
    n = 3000
    model = _fsdp_shard(_Linear(n), world_size)
    state = ddp_triton.fsdp.register(model, comm_dtype="auto", tune="online", formats=["fp32", "fp8e4m3+ef"])
    truth, seen = _switching_steps(model, rank, world_size, n, lambda: state.comms[0].current.wire.name)
    names = {"fp32": "fp32", "fp8": "fp8e4m3+ef"}
    assert seen[1:13] == [names[s] for s in SWITCHING] and seen[13:] == ["fp32"] * 2, seen
    applied = -model.w.full_tensor().detach().double()
    # FP8's rounding, handed to the fp32 input; lost: bfloat16's rounding of it (see _residual_worker)
    torch.testing.assert_close(applied, truth, rtol=0, atol=2e-3)


def test_an_fsdp_group_leaving_fp8_hands_its_residuals_to_its_next_input():
    torch_path_workers(_fsdp_residual_worker, 2, timeout=180)
