"""clip_grad_norm_: torch's gradient clipping with the norm the hook's unpack already computed.

``torch.nn.utils.clip_grad_norm_`` reads every gradient to compute the total norm (for GPT-2 small, 500 MB of
float32 per step) before it scales them. With ``CommState(grad_stats=True)`` the unpack kernels computed the sum of
squares while writing the averaged gradients, so the norm costs a few tiny kernels; the scaling is torch's own.
Where the state cannot vouch for every gradient (``grad_stats.cannot_vouch``: another norm type, statistics off,
a gradient outside the latest synchronising backward or changed since, compiled autograd's per-parameter calls),
this is torch's ``clip_grad_norm_``, unchanged.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch.amp.grad_scaler import OptState

from ..log import logger
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
    registered on ``model``); when it vouches for every gradient the norm is its ``grad_norm()`` (float32, also for
    a bfloat16 model, whose norm torch would round to bfloat16), with no read of the gradients; otherwise torch's
    function runs as it is, and the reason is logged at debug level. No host synchronisation either way unless
    ``error_if_nonfinite``, which, as in torch, reads the norm back.

    ``scaler``: the ``torch.amp.GradScaler`` that scaled the loss, with automatic mixed precision. Its ``unscale_``
    divides the gradients by the loss scale without moving their version counters, so the state cannot see it:
    given the scaler, the state's norm is divided by the same factor once ``unscale_`` has run. Without it, after
    ``unscale_``, the state would report the scaled gradients' norm.
    """
    if not isinstance(model, torch.nn.Module):
        model = [model] if isinstance(model, torch.Tensor) else list(model)  # torch's convention; read twice below
    if state is None:
        state = find_state(model)
    reason = "no CommState given or registered on the model" if state is None else state.cannot_vouch(model,
                                                                                                        norm_type)
    unscale = None
    if reason is None and scaler is not None:
        unscale, reason = unscale_factor(scaler)
    if reason is not None:
        logger.debug("clip_grad_norm_: torch's clip_grad_norm_, because %s", reason)
        return torch.nn.utils.clip_grad_norm_(_parameters(model), max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    total_norm = state.grad_norm()
    if unscale is not None:
        total_norm = total_norm * unscale.to(total_norm.device)
    if error_if_nonfinite and bool(torch.logical_or(total_norm.isnan(), total_norm.isinf())):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    scale_grads_(model, max_norm, total_norm, foreach)
    return total_norm


def unscale_factor(scaler: Any) -> Tuple[Optional[torch.Tensor], Optional[str]]:
    """(factor, None): what ``scaler.unscale_`` multiplied the gradients by since its last ``update()`` (None: it
    has not run, or the scaler is disabled); or (None, reason) when the scaler's state cannot be read."""
    enabled = getattr(scaler, "is_enabled", None)
    if not callable(enabled):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if not enabled():
        return None, None
    states = getattr(scaler, "_per_optimizer_states", None)
    scale = getattr(scaler, "_scale", None)
    unscaled = getattr(OptState, "UNSCALED", None)
    if not isinstance(states, dict) or unscaled is None:
        return None, f"this torch's {type(scaler).__name__} does not show whether unscale_ ran"
    if not any(s.get("stage") is unscaled for s in states.values()):
        return None, None
    if not isinstance(scale, torch.Tensor):
        return None, f"this {type(scaler).__name__} keeps no scale tensor"
    return scale.double().reciprocal().float(), None  # the factor unscale_ multiplied by, computed as it does


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
