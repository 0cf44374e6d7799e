"""clip_grad_norm_: torch's gradient clipping with the norm the hook's unpack already computed.

``torch.nn.utils.clip_grad_norm_`` reads every gradient to compute the total norm (for GPT-2 small, 500 MB of
float32 per step) before it scales them. With ``CommState(grad_stats=True)`` the unpack kernels computed the sum of
squares while writing the averaged gradients, so the norm costs a few tiny kernels; the scaling is torch's own.
Where the state cannot vouch for every gradient (``grad_stats.bucket_factors``: another norm type, statistics off,
a gradient outside the latest synchronising backward or changed since, compiled autograd's per-parameter calls),
this is torch's ``clip_grad_norm_``, unchanged.

Automatic mixed precision: GradScaler's ``unscale_`` multiplies the gradients by 1/scale with an op that moves no
version counter, so a clip after it would, unaided, report the scaled norm and clip ``scale`` times too hard. The
scaler's own bookkeeping cannot settle it (its stage says that some ``unscale_`` ran since ``update()``, not on which
gradients, nor whether they were written again since), so the state watches the op itself
(``grad_stats.watch_unscale``): the op, not ``GradScaler.unscale_``, because subclasses (FSDP's ShardedGradScaler)
override that method but run the op, and the op is handed exactly the tensors and the factor. The watch moves their
counters and notes, per tensor, the factor and its versions around the op. The statistics are then used only where
the versions prove that every gradient they summed holds what the unpack wrote, or that times its bucket's one factor
with nothing written since: each bucket's sum of squares times its factor squared. Anything else (a bucket unscaled
in part or by two optimizers, a backward after ``unscale_``) is torch's clip. A factor applied to a float32 sum of
squares is what float32 would have computed on the unscaled values only while the scaled sum was in float32's range,
which a scale grown over thousands of steps (squares overflow, values do not) or below 1 can leave: that flag is read
back to the host after an unscale (one synchronisation; ``GradScaler.step`` makes one right after anyway), and out of
range it is torch's clip. The ``scaler`` argument is therefore not needed; it is accepted, and checked.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from ..log import logger
from . import grad_stats as stats
from .state import CommState


def find_state(model: Any) -> Optional[CommState]:
    """The CommState registered with ``triton_hook`` on ``model`` (a DDP model), or None."""
    for entry in reversed(getattr(model, "_comm_hooks", ())):
        if isinstance(entry[1], CommState):
            return entry[1]
    return None


def clip_grad_norm_(
    model: Union[torch.nn.Module, Iterable[torch.Tensor], torch.Tensor],
    max_norm: float,
    state: Optional[CommState] = None,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    scaler: Any = None,
) -> torch.Tensor:
    """Clip the gradients of ``model``'s parameters to total norm ``max_norm``; return the total norm.

    The contract of ``torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite,
    foreach)``: the total norm of all gradients (as one vector), and each gradient multiplied in place by
    ``clamp(max_norm / (total_norm + 1e-6), max=1.0)``. ``model`` is the DDP model, or its parameters as torch's
    function takes them (an iterable, or one tensor). ``state`` is the model's CommState (default: the one
    registered on ``model``); when it vouches for every gradient the norm is its ``grad_norm()``, or after
    GradScaler's ``unscale_`` the unscaled gradients' norm from the same statistics (float32, also for a bfloat16
    model, whose norm torch would round to bfloat16), with no read of the gradients; otherwise torch's function runs
    as it is, and the reason is logged at debug level. No host synchronisation either way, except one read of a flag
    after ``unscale_`` and, as in torch, the norm's with ``error_if_nonfinite``.

    ``scaler``: the ``torch.amp.GradScaler`` that scaled the loss, if any. Not needed: ``unscale_`` is seen without
    it (module docstring); accepted, and checked, for the loops that pass it.
    """
    if scaler is not None and not callable(getattr(scaler, "is_enabled", None)):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if not isinstance(model, torch.nn.Module):
        model = [model] if isinstance(model, torch.Tensor) else list(model)  # torch's convention; read twice below
    if state is None:
        state = find_state(model)
    if state is None:
        total_norm, reason = None, "no CommState given or registered on the model"
    else:
        entries = state.latest_pass()
        total_norm, reason = stats.clip_norm(model, entries, state.passes - 1,
                                             stats.why_no_stats(state.grad_stats, state.per_parameter_calls, entries),
                                             norm_type)
    if total_norm is None:
        logger.debug("clip_grad_norm_: torch's clip_grad_norm_, because %s", reason)
        return torch.nn.utils.clip_grad_norm_(_parameters(model), max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    if error_if_nonfinite and bool(torch.logical_or(total_norm.isnan(), total_norm.isinf())):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    scale_grads_(model, max_norm, total_norm, foreach)
    return total_norm


def _parameters(model: Any) -> Any:
    return model.parameters() if isinstance(model, torch.nn.Module) else model


@torch.no_grad()
def scale_grads_(model: Any, max_norm: float, total_norm: torch.Tensor, foreach: Optional[bool] = None) -> None:
    """torch's scaling step: every gradient times ``clamp(max_norm / (total_norm + 1e-6), max=1.0)``, in place."""
    clip_with_norm = getattr(torch.nn.utils, "clip_grads_with_norm_", None)  # torch >= 2.6
    if clip_with_norm is not None:
        clip_with_norm(_parameters(model), max_norm, total_norm, foreach=foreach)
        return
    grads = [p.grad for p in _parameters(model) if p.grad is not None]
    if not grads:
        return
    clip_coef_clamped = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_device: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in by_device.items():
        coef = clip_coef_clamped.to(device)
        if foreach is not False and device.type in ("cuda", "cpu"):
            torch._foreach_mul_(group, coef)
        else:
            for g in group:
                g.mul_(coef)
