"""Gradient norm, non-finite check and clip_grad_norm_ from the hook's unpack statistics (grad_stats=True).

Tiers: gloo multi-process on CPU at world sizes 2 and 3 (spawned here, the kernels' torch CPU path, as in CPU
production); every case of one world size runs in one spawned job, to keep the suite fast. One GPU test (NCCL at
world size 1, the AVG path and CUDA events) runs where CUDA is present and skips otherwise.

The reference is torch itself on the same averaged gradients: ``torch.nn.utils.clip_grad_norm_`` on copies of the
gradients the hook produced, and their norm in float64. ``ddp_triton.clip_grad_norm_`` must give torch's norm and
torch's clipped gradients, without calling torch's function when the state vouches for the gradients (it is
patched to fail there), and must call it, with the same results, in each fallback case. With automatic mixed
precision the same holds after GradScaler's ``unscale_``, whether the clip is given the scaler or not.
"""

import math
import os
import pickle
from unittest import mock

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_helpers import (OUT, Branchy, TwoDtypes, local_backward, local_slice, make_data, make_model, step,
                         torch_path_workers)

TORCH_CLIP = torch.nn.utils.clip_grad_norm_

# float32 gradients: the state sums squares per bucket in float32 where torch takes a norm per tensor and then the
# norm of the norms; over ~1.5k values that is a different float32 summation order, a few ulps (1.2e-7 each).
FP32_RTOL = 1e-5
# bfloat16 gradients: torch returns the norm of its bfloat16 tensors rounded to bfloat16 (2**-9 relative) before
# it combines them, while the state keeps float32; clipped bfloat16 gradients may then round one ulp (2**-8) apart.
BF16_RTOL = 2**-7


def float64_norm(model):
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    return math.sqrt(sum(float(g.square().sum()) for g in grads))


def torch_reference(model, max_norm, norm_type=2.0):
    """torch's clip_grad_norm_ on copies of the model's gradients: (total norm, clipped gradients or None)."""
    shadows = []
    for p in model.parameters():
        s = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        s.grad = None if p.grad is None else p.grad.clone()
        shadows.append(s)
    norm = TORCH_CLIP(shadows, max_norm, norm_type)
    return norm, [s.grad for s in shadows]


def assert_grads(model, expected, rtol):
    for (name, p), g in zip(model.named_parameters(), expected):
        if g is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, g, rtol=rtol, atol=1e-7, msg=name)


def check_clip_via_state(ddp, state, max_norm, rtol=FP32_RTOL, scaler=None, params=None, unscaled=False):
    """The state vouches, its norm is the gradients' norm, and its clip is torch's without calling torch's.
    ``params``: a function giving what to clip, as torch's clip takes it (default: the DDP model itself).
    ``unscaled``: GradScaler's unscale_ ran since the backward (the state's own norm is then the scaled one); the
    clip, given ``scaler`` or not, must find the unscaled gradients' norm from the statistics all the same."""
    target = ddp if params is None else params()
    why = state.cannot_vouch(ddp)
    assert (why is None) if not unscaled else (why is not None and "unscale_" in why), why
    norm = state.grad_norm()
    assert norm.dim() == 0 and norm.dtype == torch.float32 and norm.device == next(ddp.parameters()).device
    if not unscaled:
        assert float(norm) == pytest.approx(float64_norm(ddp), rel=FP32_RTOL)  # float32 sums against float64
    assert float(state.found_inf()) == 0.0
    expected_norm, expected_grads = torch_reference(ddp, max_norm)
    with mock.patch.object(torch.nn.utils, "clip_grad_norm_", side_effect=AssertionError("torch's clip ran")):
        clipped = ddp_triton.clip_grad_norm_(target, max_norm, state=state, scaler=scaler)
    assert float(clipped) == pytest.approx(float(expected_norm), rel=rtol)
    assert_grads(ddp, expected_grads, rtol)
    return float(clipped)


def check_fallback(ddp, state, max_norm, reason, norm_type=2.0, params=None, scaler=None):
    """The state declines (saying ``reason``, or one of several) and clip_grad_norm_ is torch's, with torch's
    results."""
    target = ddp if params is None else params()
    why = state.cannot_vouch(params() if params is not None else ddp, norm_type) if state is not None \
        else "no CommState"
    reasons = (reason,) if isinstance(reason, str) else reason
    assert why is not None and any(r in why for r in reasons), why
    expected_norm, expected_grads = torch_reference(ddp, max_norm, norm_type)
    if params is not None:  # torch's clip over only those given
        chosen = {id(p) for p in params()}
        grads = [p.grad for p in ddp.parameters() if id(p) in chosen and p.grad is not None]
        expected_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) \
            if grads else torch.tensor(0.0)
        coef = torch.clamp(max_norm / (expected_norm + 1e-6), max=1.0)
        expected_grads = [None if p.grad is None else (p.grad * coef if id(p) in chosen else p.grad.clone())
                          for p in ddp.parameters()]
    with mock.patch.object(torch.nn.utils, "clip_grad_norm_", wraps=TORCH_CLIP) as torch_clip:
        clipped = ddp_triton.clip_grad_norm_(target, max_norm, state=state, norm_type=norm_type, scaler=scaler)
    assert torch_clip.call_count == 1
    assert float(clipped) == float(expected_norm)
    assert_grads(ddp, expected_grads, rtol=0)


# ---- the cases, run one after another in each spawned job --------------------------------------------------------


def _several_buckets(rank, world_size):
    # bfloat16 and float16 on the wire (a kernel each way) and float32 (in place: the pack scales, the unpack is the
    # stats pass), gradients as bucket views or copied out of the buckets, through DDP's rebuild of its buckets
    for comm_dtype in (torch.bfloat16, torch.float16, torch.float32):
        for gabv in (False, True):
            ddp = DDP(make_model(), bucket_cap_mb=0.002, gradient_as_bucket_view=gabv)
            state = ddp_triton.register(ddp, comm_dtype=comm_dtype, grad_stats=True)
            for s, max_norm in enumerate((0.05, 1e3)):  # clipped, then a coefficient clamped to 1
                step(ddp, rank, world_size, s)
                if s == 1:  # DDP's buckets after its rebuild (the first pass has one large first bucket)
                    assert sum(e.record.last_used == state.passes - 1 for e in state.plans.values()) > 1
                check_clip_via_state(ddp, state, max_norm)


def _no_sync(rank, world_size):
    for gabv in (False, True):
        ddp = DDP(make_model(), bucket_cap_mb=0.002, gradient_as_bucket_view=gabv)
        state = ddp_triton.register(ddp, grad_stats=True)
        for s in range(2):
            ddp.zero_grad()
            with ddp.no_sync():  # accumulates locally; the hook does not run
                x, y = make_data(10 * s)
                local_backward(ddp, x, y, rank, world_size)
            passes = state.passes
            x, y = make_data(10 * s + 1)
            local_backward(ddp, x, y, rank, world_size)
            assert state.passes == passes + 1  # the statistics are the synchronising backward's
            check_clip_via_state(ddp, state, 0.05)


class Partly(Branchy):
    """A branch used on some ranks or steps only (find_unused_parameters), then a frozen layer (no gradient)."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(OUT, OUT).requires_grad_(False)

    def forward(self, x):
        return self.frozen(super().forward(x))


def _unused_parameters(rank, world_size):
    for gabv in (False, True):
        model = Partly()
        ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=gabv)
        state = ddp_triton.register(ddp, grad_stats=True)
        for s, use in enumerate((rank == 0, False, True)):  # used on rank 0 only, on no rank, on every rank
            model.use_branch = use
            step(ddp, rank, world_size, s)
            assert model.frozen.weight.grad is None
            if s == 1 and not gabv:  # unused everywhere: DDP leaves their gradients unset; torch skips them too
                assert model.branch.weight.grad is None
            check_clip_via_state(ddp, state, 0.05)


def _mixed_dtypes(rank, world_size):
    # float32 and bfloat16 parameters: DDP gives each dtype its own buckets; bfloat16 on the wire sends the bfloat16
    # bucket in place (the unpack is then the stats pass), float32 on the wire widens it
    for comm_dtype in (torch.bfloat16, torch.float32):
        for gabv in (False, True):
            model = TwoDtypes()
            ddp = DDP(model, gradient_as_bucket_view=gabv)
            state = ddp_triton.register(ddp, comm_dtype=comm_dtype, grad_stats=True)
            x, y = make_data(0)
            ddp.zero_grad()
            nn.functional.mse_loss(ddp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
            assert {e.buffer.dtype for e in state.plans.values()} == {torch.float32, torch.bfloat16}
            check_clip_via_state(ddp, state, 0.05, rtol=BF16_RTOL)


def _non_finite(rank, world_size):
    ddp = DDP(make_model(), bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, grad_stats=True)
    for poison in (math.inf, math.nan):
        ddp.zero_grad()
        x, y = make_data(0)
        loss = nn.functional.mse_loss(ddp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        (loss * (poison if rank == world_size - 1 else 1.0)).backward()  # the last rank's gradients only
        assert float(state.found_inf()) == 1.0, "every rank sees the non-finite average"
        assert state.cannot_vouch(ddp) is None
        ours = state.grad_norm()
        theirs, _ = torch_reference(ddp, 1.0)
        assert not math.isfinite(float(ours)) and math.isnan(float(ours)) == math.isnan(float(theirs))
        with pytest.raises(RuntimeError, match="non-finite"):
            ddp_triton.clip_grad_norm_(ddp, 1.0, state=state, error_if_nonfinite=True)
    step(ddp, rank, world_size, 1)
    assert float(state.found_inf()) == 0.0
    check_clip_via_state(ddp, state, 0.05)


def _join(rank, world_size):
    ddp = DDP(make_model(), bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, grad_stats=True)
    with ddp.join():
        for s in range(2 + rank):  # uneven inputs: rank r has 2 + r batches
            step(ddp, rank, world_size, s)
            check_clip_via_state(ddp, state, 0.05)


def _fallbacks(rank, world_size):
    ddp = DDP(make_model(), bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, grad_stats=True)
    with pytest.raises(RuntimeError, match="no backward pass"):
        state.grad_norm()
    step(ddp, rank, world_size, 0)
    check_fallback(ddp, state, 0.05, "norm_type", norm_type=math.inf)
    step(ddp, rank, world_size, 0)
    check_fallback(ddp, state, 0.05, "norm_type", norm_type=1.0)
    step(ddp, rank, world_size, 0)
    first = next(ddp.parameters())
    first.grad.mul_(2.0)  # changed in place after the backward
    check_fallback(ddp, state, 0.05, "changed since")
    step(ddp, rank, world_size, 0)
    first.grad = first.grad.clone()  # replaced
    check_fallback(ddp, state, 0.05, "changed since")
    step(ddp, rank, world_size, 0)
    before = float(state.grad_norm())
    with ddp.no_sync():  # a backward that accumulates after the synchronising one
        x, y = make_data(1)
        local_backward(ddp, x, y, rank, world_size)
    assert float(state.grad_norm()) == before  # still the synchronising backward's norm, as documented
    check_fallback(ddp, state, 0.05, "changed since")
    # a gradient on a parameter DDP does not reduce
    frozen = nn.Linear(OUT, OUT).requires_grad_(False)
    frozen_ddp = DDP(nn.Sequential(make_model(), frozen), bucket_cap_mb=0.002)
    frozen_state = ddp_triton.register(frozen_ddp, grad_stats=True)
    step(frozen_ddp, rank, world_size, 0)
    frozen.weight.grad = torch.ones_like(frozen.weight)
    check_fallback(frozen_ddp, frozen_state, 0.05, "not in the latest synchronising backward")
    # copied-out gradients (the default) with find_unused_parameters and zero_grad(set_to_none=False): DDP leaves
    # a gradient unused on every rank as it was, which the state cannot vouch for
    model = Partly()
    partly = DDP(model, find_unused_parameters=True)
    partly_state = ddp_triton.register(partly, grad_stats=True)
    model.use_branch = True
    step(partly, rank, world_size, 0, set_to_none=False)
    model.use_branch = False
    step(partly, rank, world_size, 1, set_to_none=False)
    check_fallback(partly, partly_state, 0.05, "did not write it")
    # statistics off, no state at all, the per-parameter calls of compiled autograd's Python reducer
    plain = DDP(make_model(), bucket_cap_mb=0.002)
    plain_state = ddp_triton.register(plain)
    step(plain, rank, world_size, 0)
    with pytest.raises(RuntimeError, match="grad_stats=True"):
        plain_state.found_inf()
    check_fallback(plain, plain_state, 0.05, "without grad_stats")
    no_hook = DDP(make_model(), bucket_cap_mb=0.002)
    step(no_hook, rank, world_size, 0)
    check_fallback(no_hook, None, 0.05, "no CommState")
    step(ddp, rank, world_size, 0)
    for p in ddp.parameters():  # what DDP's Python reducer calls under compiled autograd (traced, there)
        ddp_triton.triton_hook(state, (p.grad, p))
    with pytest.raises(RuntimeError, match="per parameter"):
        state.grad_norm()
    check_fallback(ddp, state, 0.05, "per parameter")
    # the settings survive pickling (torch.save of a whole model)
    restored = pickle.loads(pickle.dumps(ddp_triton.CommState(grad_stats=True, timing=True, profile=None)))
    assert restored.grad_stats and restored.timing


def scaled_backward(ddp, scaler, rank, world_size, data_step):
    """zero_grad, then this rank's backward of its loss scaled by ``scaler`` (automatic mixed precision's loop)."""
    ddp.zero_grad()
    x, y = make_data(data_step)
    loss = nn.functional.mse_loss(ddp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
    scaler.scale(loss).backward()


ALL_LAYOUTS = ((False, False), (False, True), (True, False), (True, True))


def _amp_loop(rank, world_size, layouts=ALL_LAYOUTS, **options):
    """torch's AMP loop: scaled backward, unscale_, clip, step, update; the clip given the scaler or not (as users
    copy torch's loop), the state's clip before unscale_ (the scaled norm) and a step with no clip at all.
    ``layouts``: (gradient_as_bucket_view, whether the clip is given the scaler) pairs."""
    for gabv, give_scaler in layouts:
        ddp = DDP(make_model(), bucket_cap_mb=0.002, gradient_as_bucket_view=gabv)
        state = ddp_triton.register(ddp, grad_stats=True, **options)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)  # the scale changes per step
        passed = scaler if give_scaler else None
        for s in range(4):
            scaled_backward(ddp, scaler, rank, world_size, s)
            if s == 1:  # clipping the scaled gradients, before unscale_: the scaled norm, as torch's
                scaled = check_clip_via_state(ddp, state, 1e6, scaler=passed)
                scaler.unscale_(opt)
            elif s == 2:  # unscale_ without a clip
                scaler.unscale_(opt)
            else:
                scaler.unscale_(opt)
                unscaled = check_clip_via_state(ddp, state, 1.0, scaler=passed, unscaled=True)
            scaler.step(opt)
            scaler.update()
        assert scaler.get_scale() == 1024.0 * 2**4  # no step skipped: every step went through unscale_
        assert scaled > 100 * unscaled, (scaled, unscaled)  # a scale of 2048 between them, up to two steps'


def _amp(rank, world_size):
    _amp_loop(rank, world_size)  # bfloat16 on the wire; FP8 and two-level: _fp8_amp, _two_level_worker

    # A disabled scaler's unscale_ does nothing: the gradients are as the unpack wrote them.
    ddp = DDP(make_model(), bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, grad_stats=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    off = torch.amp.GradScaler("cpu", enabled=False)
    scaled_backward(ddp, off, rank, world_size, 0)
    off.unscale_(opt)
    check_clip_via_state(ddp, state, 0.05, scaler=off)

    # unscale_, then a no_sync backward accumulating into the unscaled gradients: torch's clip (they changed)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaled_backward(ddp, scaler, rank, world_size, 0)
    scaler.unscale_(opt)
    with ddp.no_sync():
        x, y = make_data(1)
        local_backward(ddp, x, y, rank, world_size)
    check_fallback(ddp, state, 0.05, "changed since")
    scaler.step(opt)
    scaler.update()

    # The scaled gradients' sum of squares out of float32's range while the unscaled gradients' is not (a scale that
    # grew for many steps, or one below 1): the norm from the statistics would be inf or 0; torch's clip runs.
    with pytest.raises(TypeError, match="GradScaler"):
        ddp_triton.clip_grad_norm_(ddp, 0.05, scaler="not a scaler")
    for init_scale in (2.0**100, 2.0**-100):
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        scaled_backward(ddp, scaler, rank, world_size, 0)
        assert float(state.found_inf()) == 0.0
        scaler.unscale_(opt)
        with mock.patch.object(ddp_triton.runtime.clip.logger, "debug") as debug:
            check_fallback(ddp, state, 0.05, "unscale_", scaler=scaler)
        assert "float32's range" in debug.call_args[0][1], debug.call_args
        scaler.step(opt)
        scaler.update()
    # The scaled gradients' sum in range, the unscaled gradients' not (a loss of 1e20 under a scale of 2**-70): torch
    # sums the unscaled squares in float32 to inf, and so must the clip.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-70)
    ddp.zero_grad()
    x, y = make_data(0)
    loss = nn.functional.mse_loss(ddp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
    scaler.scale(loss * 1e20).backward()
    scaler.unscale_(opt)
    with mock.patch.object(ddp_triton.runtime.clip.logger, "debug") as debug:
        check_fallback(ddp, state, 0.05, "unscale_", scaler=scaler)
    assert "float32's range" in debug.call_args[0][1], debug.call_args
    scaler.update()

    # Two optimizers, each with whole buckets: unscale_ of one, then of both (a factor per bucket)
    for gabv in (False, True):
        ddp = DDP(make_model(), bucket_cap_mb=0.002, gradient_as_bucket_view=gabv)
        state = ddp_triton.register(ddp, grad_stats=True)
        step(ddp, rank, world_size, 0)
        step(ddp, rank, world_size, 1)  # after DDP's rebuild of its buckets
        buckets = [e.coverage.params for e in state.latest_pass()]
        assert len(buckets) > 1
        first = {id(p) for p in buckets[0]}
        opts = [torch.optim.SGD([p for p in ddp.parameters() if (id(p) in first) == mine], lr=0.01)
                for mine in (True, False)]
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaled_backward(ddp, scaler, rank, world_size, 2)
        scaler.unscale_(opts[0])
        check_clip_via_state(ddp, state, 1.0, unscaled=True)  # one bucket unscaled, the others scaled, as torch sees
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        scaled_backward(ddp, scaler, rank, world_size, 3)
        for opt in opts:
            scaler.unscale_(opt)
        check_clip_via_state(ddp, state, 1.0, unscaled=True)
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        # ... and two optimizers that share a bucket: unscale_ of one leaves the bucket half scaled: torch's clip
        shared = [p for p in buckets if len(p) > 1][0]
        opts = [torch.optim.SGD([p for p in ddp.parameters() if (p is shared[0]) == mine], lr=0.01)
                for mine in (True, False)]
        for unscaled in (opts[:1], opts[1:], opts):
            scaled_backward(ddp, scaler, rank, world_size, 4)
            for opt in unscaled:
                scaler.unscale_(opt)
            # bucket views share the bucket's counter, which the other optimizer's unscale_ (or none) moved on
            check_fallback(ddp, state, 1.0, "changed since" if gabv else "differently")
            for opt in opts:
                scaler.step(opt)
            scaler.update()

    # A GradScaler that overrides unscale_ (FSDP's ShardedGradScaler, here with DDP on CPU): seen all the same. Older
    # torch's unscaled CPU gradients through .data (``_foreach_non_finite_check_and_unscale_cpu_``), which no version
    # counter sees; the state cannot vouch there.
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    if hasattr(ShardedGradScaler, "_foreach_non_finite_check_and_unscale_cpu_"):
        return
    ddp = DDP(make_model(), bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, grad_stats=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    sharded = ShardedGradScaler(device="cpu", init_scale=1024.0)
    assert type(sharded).unscale_ is not torch.amp.GradScaler.unscale_
    for s in range(2):
        scaled_backward(ddp, sharded, rank, world_size, s)
        sharded.unscale_(opt)
        check_clip_via_state(ddp, state, 1.0, unscaled=True)
        sharded.step(opt)
        sharded.update()


def _fp8_amp(rank, world_size):
    _amp_loop(rank, world_size, layouts=((False, False), (True, False)), comm_dtype=torch.float8_e4m3fn)


def _dropped_and_parameter_lists(rank, world_size):
    for gabv in (False, True):
        ddp = DDP(make_model(), bucket_cap_mb=0.002, gradient_as_bucket_view=gabv)
        state = ddp_triton.register(ddp, grad_stats=True)
        # Gradients dropped after the backward: the norm of the pass counts them, torch's clip does not.
        step(ddp, rank, world_size, 0)
        ddp.module[2].weight.grad = None
        check_fallback(ddp, state, 1.0, "dropped")
        step(ddp, rank, world_size, 0)
        ddp.zero_grad()
        check_fallback(ddp, state, 1.0, "dropped")
        # torch's calling convention: the parameters (a generator), all of them, or only some
        step(ddp, rank, world_size, 0)
        check_clip_via_state(ddp, state, 0.05, params=ddp.parameters)
        step(ddp, rank, world_size, 0)
        check_fallback(ddp, state, 0.05, "not given", params=lambda: list(ddp.parameters())[:2])
        step(ddp, rank, world_size, 0)
        check_fallback(ddp, None, 0.05, "no CommState", params=ddp.parameters)


def _grad_stats_worker(rank, world_size):
    for case in (_several_buckets, _no_sync, _unused_parameters, _mixed_dtypes, _non_finite, _join):
        case(rank, world_size)
    if world_size == 2:  # the fallbacks do not depend on the world size: once is enough
        _fallbacks(rank, world_size)
        _amp(rank, world_size)
        _fp8_amp(rank, world_size)
        _dropped_and_parameter_lists(rank, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_grad_norm_found_inf_and_clip_match_torch(world_size):
    torch_path_workers(_grad_stats_worker, world_size)


def _two_level_worker(rank, world_size):
    os.environ["GROUP_RANK"] = str(rank // 2)  # 2 nodes x 2 ranks
    for options in (dict(comm_dtype=torch.bfloat16), dict(comm_dtype=torch.float8_e4m3fn)):
        ddp = DDP(make_model(), bucket_cap_mb=0.002)
        state = ddp_triton.register(ddp, grad_stats=True, hierarchical=True, **options)
        assert state.context.nodes is not None
        for s, max_norm in enumerate((0.05, 1e3)):
            step(ddp, rank, world_size, s)
            check_clip_via_state(ddp, state, max_norm)
        _amp_loop(rank, world_size, layouts=((False, False),), hierarchical=True, **options)


def test_two_level_statistics_are_the_averaged_gradients():
    """The two-level exchange's last pass (the unpack after the node's all-gather) gives the statistics."""
    torch_path_workers(_two_level_worker, 4)


def test_unscale_op_moves_version_counters_and_notes_its_factor():
    """What the watch on GradScaler's op does: wraps once (picklable), moves each given tensor's counter once (a
    bucket's views share theirs), notes the factor used and the versions around the op; a tensor given twice is
    counted, not noted; inside torch.compile it runs eagerly (traced, the counter would not move)."""
    from ddp_triton.runtime import grad_stats

    grad_stats.watch_unscale()
    watched = torch._amp_foreach_non_finite_check_and_unscale_
    grad_stats.watch_unscale()
    assert torch._amp_foreach_non_finite_check_and_unscale_ is watched and watched.counts_versions
    assert pickle.loads(pickle.dumps(watched)) is watched
    bucket, alone = torch.ones(10), torch.ones(3)
    views = [bucket[:4], bucket[4:]]
    found, inv_scale = torch.zeros(()), torch.tensor(0.25)
    watched(views + [alone], found, inv_scale)
    assert bucket.tolist() == [0.25] * 10 and alone.tolist() == [0.25] * 3 and float(found) == 0.0
    assert alone._version == 1 and bucket._version == 2 and views[0]._version == 2
    inv_scale.fill_(8.0)  # the factor noted is the one used
    for t, after in ((alone, 1), (views[0], 2), (views[1], 2)):
        factor, noted_after = grad_stats.unscaled_since(t, 0)
        assert float(factor) == 0.25 and noted_after == after
    assert grad_stats.unscaled_since(alone, 1) is None  # a version noted after the op: no unscale since
    twice = torch.ones(2)
    watched([twice, twice], found, torch.tensor(0.5))
    assert twice._version == 2 and grad_stats.unscaled_since(twice, 0) is None

    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    grad = model.weight.grad
    expected = grad / 8
    torch.compile(lambda: scaler.unscale_(opt), backend="aot_eager")()
    assert torch.equal(grad, expected) and grad._version == 1
    assert float(grad_stats.unscaled_since(grad, 0)[0]) == 0.125


def test_in_place_unpack_at_scale_one_is_a_stats_pass():
    """What the AVG and in-place buckets run with stats on: the values stay, the statistics are theirs."""
    from ddp_triton.kernels import unpack

    for dtype in (torch.float32, torch.bfloat16):
        buffer = torch.randn(1000).to(dtype)
        buffer[7] = math.inf
        before = buffer.clone()
        stats = torch.full((2,), -1.0)
        unpack.prepare(buffer, [buffer], 1.0, stats=stats).fixed(buffer, [buffer], stats)()
        assert torch.equal(buffer, before)
        finite = before.float()[torch.isfinite(before)]
        assert float(stats[1]) == 1.0 and float(stats[0]) == math.inf
        stats_finite = torch.zeros(2)
        buffer[7] = 0.0
        unpack.prepare(buffer, [buffer], 1.0, stats=stats_finite).fixed(buffer, [buffer], stats_finite)()
        assert float(stats_finite[0]) == pytest.approx(float(finite.double().square().sum()), rel=FP32_RTOL)


# ---- GPU: NCCL at world size 1, where float32 buckets take NCCL's AVG ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("comm_dtype", [torch.float32, torch.bfloat16], ids=["avg", "bf16"])
def test_grad_stats_over_nccl(nccl_world_of_one, comm_dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    ddp = DDP(model, device_ids=[0], gradient_as_bucket_view=True, bucket_cap_mb=0.01)
    state = ddp_triton.register(ddp, comm_dtype=comm_dtype, profile=None, grad_stats=True, timing=True)
    x = torch.randn(32, 64, device="cuda")
    for _ in range(3):  # the third step runs on the buckets DDP rebuilt after the first
        ddp.zero_grad()
        ddp(x).square().mean().backward()
    if comm_dtype == torch.float32:
        assert all(e.record.wire_format == "float32 (AVG)" for e in state.plans.values())
    check_clip_via_state(ddp, state, 0.01)
    summary = state.summary()
    assert summary.clock == "cuda events"
    assert all(b.pack_ms is not None and b.comm_ms >= 0 and b.unpack_ms >= 0 for b in summary.buckets)


@pytest.mark.gpu
def test_clip_after_grad_scaler_unscale_over_nccl(nccl_world_of_one):
    """The AMP pattern on CUDA: scaled backward, unscale_, the state's clip (given the scaler or not) against
    torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    ddp = DDP(model, device_ids=[0], gradient_as_bucket_view=True, bucket_cap_mb=0.01)
    state = ddp_triton.register(ddp, profile=None, grad_stats=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    x = torch.randn(32, 64, device="cuda")
    for s in range(4):
        ddp.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = ddp(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        check_clip_via_state(ddp, state, 0.01, scaler=scaler if s % 2 else None, unscaled=True)
        scaler.step(opt)
        scaler.update()
