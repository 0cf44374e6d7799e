"""clip_grad_norm_: torch's gradient clipping with the norm the hook's unpack already computed.

``torch.nn.utils.clip_grad_norm_`` reads every gradient to compute the total norm (for GPT-2 small, 500 MB of
float32 per step) before it scales them. With ``CommState(grad_stats=True)`` the unpack kernels computed the sum of
squares while writing the averaged gradients, so the norm costs a few tiny kernels; the scaling is torch's own.
Where the state cannot vouch for every gradient (``grad_stats.cannot_vouch``: another norm type, statistics off,
a gradient outside the latest synchronising backward or changed since, compiled autograd's per-parameter calls),
this is torch's ``clip_grad_norm_``, unchanged.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..log import logger
from .grad_stats import cannot_vouch, grad_norm
from .state import CommState


def find_state(model: torch.nn.Module) -> Optional[CommState]:
    """The CommState registered with ``triton_hook`` on ``model`` (a DDP model), or None."""
    for entry in reversed(getattr(model, "_comm_hooks", ())):
        if isinstance(entry[1], CommState):
            return entry[1]
    return None


def clip_grad_norm_(
    model: torch.nn.Module,
    max_norm: float,
    state: Optional[CommState] = None,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    """Clip the gradients of ``model``'s parameters to total norm ``max_norm``; return the total norm.

    The contract of ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type, error_if_nonfinite,
    foreach)``: the total norm of all gradients (as one vector), and each gradient multiplied in place by
    ``clamp(max_norm / (total_norm + 1e-6), max=1.0)``. ``state`` is the model's CommState (default: the one
    registered on ``model``); when it vouches for every gradient the norm is its ``grad_norm()`` (float32, also for
    a bfloat16 model, whose norm torch would round to bfloat16), with no read of the gradients; otherwise torch's
    function runs as it is, and the reason is logged at debug level. No host synchronisation either way unless
    ``error_if_nonfinite``, which, as in torch, reads the norm back.
    """
    if state is None:
        state = find_state(model)
    reason = "no CommState given or registered on the model" if state is None else cannot_vouch(model, state,
                                                                                                  norm_type)
    if reason is not None:
        logger.debug("clip_grad_norm_: torch's clip_grad_norm_, because %s", reason)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    total_norm = grad_norm(state)
    if error_if_nonfinite and bool(torch.logical_or(total_norm.isnan(), total_norm.isinf())):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    scale_grads_(model, max_norm, total_norm, foreach)
    return total_norm


@torch.no_grad()
def scale_grads_(model: torch.nn.Module, max_norm: float, total_norm: torch.Tensor,
                 foreach: Optional[bool] = None) -> None:
    """torch's scaling step: every gradient times ``clamp(max_norm / (total_norm + 1e-6), max=1.0)``, in place."""
    clip_with_norm = getattr(torch.nn.utils, "clip_grads_with_norm_", None)  # torch >= 2.6
    if clip_with_norm is not None:
        clip_with_norm(model.parameters(), max_norm, total_norm, foreach=foreach)
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
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
