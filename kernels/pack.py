"""pack and unpack: the typed launchers around the conversion kernels.

``pack`` flattens a list of tensors into one buffer, scaling and casting on the way (the step before an
all-reduce); ``unpack`` is the way back. Both take one pass over the data whatever the number of tensors: one launch
on CUDA, the same kernel in Triton's interpreter for CPU tensors when ``TRITON_INTERPRET=1``, and otherwise the torch
path for CPU tensors, all with the same bits. ``bind_pack``/``bind_unpack`` check and plan once and return a launch
to replay, for callers (the DDP hook) that repeat the same layout every step.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from . import _triton, torch_path
from .convert import OUT_BF16, OUT_FP16, OUT_FP32
from .launch import ONE_SHOT, BoundLaunch, kernel_arguments
from .validation import check_flat, check_overlap, check_scale, check_tensor_list
from .worklist import PLANS

_OUT_KIND = {torch.bfloat16: OUT_BF16, torch.float16: OUT_FP16, torch.float32: OUT_FP32}
_BITS_DTYPE = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def uses_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through the Triton kernel (CUDA, or CPU under the interpreter)."""
    if not _triton.AVAILABLE:
        return False
    return device.type == "cuda" or (device.type == "cpu" and _triton.INTERPRETER)


def _check_stats(stats: Optional[torch.Tensor], device: torch.device) -> None:
    if stats is None:
        return
    if not isinstance(stats, torch.Tensor) or stats.dtype != torch.float32 or stats.shape != (2,):
        raise ValueError("stats must be a float32 tensor of shape (2,)")
    if stats.device != device:
        raise ValueError(f"stats is on {stats.device} but the tensors are on {device}")
    if not stats.is_contiguous():
        raise ValueError("stats must be contiguous")


def _launcher(plan, args: tuple, tensors, bind: bool) -> Callable[[], None]:
    """A bound launch (kept tensors, direct launcher) for ``bind_*``; for a plain call, the shared one-shot cache
    (which holds no tensors)."""
    if bind:
        return BoundLaunch(plan, *args, keepalive=tensors)
    return lambda: ONE_SHOT(plan, *args)


def _prepare_pack(tensors, out, scale, bind: bool) -> Callable[[], None]:
    tensors = check_tensor_list(tensors, "tensors")
    scale = check_scale(scale)
    check_flat(out, "out", sum(t.numel() for t in tensors), tensors)
    in_place = check_overlap(tensors, out, "out", tensors_written=False)
    if (in_place and scale == 1.0) or out.numel() == 0:
        return lambda: None
    if not uses_triton(out.device):
        return lambda: torch_path.pack(tensors, out, scale)
    plan = PLANS.get(tensors, out, many_is_source=True)
    dst = out.view(_BITS_DTYPE[out.dtype])
    args = kernel_arguments(plan, tensors[plan.many_base], dst, scale, _OUT_KIND[out.dtype], None)
    return _launcher(plan, args, tensors, bind)


def _prepare_unpack(flat, tensors, scale, stats, bind: bool) -> Callable[[], None]:
    tensors = check_tensor_list(tensors, "tensors")
    scale = check_scale(scale)
    check_flat(flat, "flat", sum(t.numel() for t in tensors), tensors)
    _check_stats(stats, flat.device)
    in_place = check_overlap(tensors, flat, "flat", tensors_written=True)
    if (in_place and scale == 1.0 and stats is None) or flat.numel() == 0:
        return stats.zero_ if stats is not None else (lambda: None)
    if not uses_triton(flat.device):
        return lambda: torch_path.unpack(flat, tensors, scale, stats)
    plan = PLANS.get(tensors, flat, many_is_source=False)
    base = tensors[plan.many_base]
    dst = base.view(_BITS_DTYPE[base.dtype])
    if stats is None:
        return _launcher(plan, kernel_arguments(plan, flat, dst, scale, _OUT_KIND[base.dtype], None), tensors, bind)

    partials = torch.empty((plan.n_items, 2), dtype=torch.float32, device=flat.device)
    args = kernel_arguments(plan, flat, dst, scale, _OUT_KIND[base.dtype], partials)
    kernel_launch = _launcher(plan, args, tensors, bind)

    def run_with_stats() -> None:
        kernel_launch()
        torch.sum(partials, dim=0, out=stats)

    return run_with_stats


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Write ``concat(t.flatten() for t in tensors) * scale`` into ``out``, rounded once to ``out.dtype``.

    Bit-for-bit ``torch.cat([t.flatten().float() for t in tensors]).mul(scale).to(out.dtype)``, except that every
    NaN is written as the canonical quiet NaN of ``out.dtype``. Tensors share one dtype and device (float32,
    bfloat16 or float16) and must be contiguous; ``out`` is a contiguous 1-D tensor of the total size, of any of the
    three dtypes. ``out`` may be the very same memory as the tensors (in-place scaling); any other overlap is refused.
    Returns ``out``.
    """
    _prepare_pack(tensors, out, scale, bind=False)()
    return out


def unpack(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    scale: float = 1.0,
    *,
    stats: Optional[torch.Tensor] = None,
) -> None:
    """Give each tensor its slice of ``flat`` times ``scale``, rounded once to the tensor's dtype.

    The inverse of :func:`pack`, in one pass. If ``stats`` (a float32 tensor of shape (2,)) is given, the same pass
    also writes into it the sum of squares of the values stored and the number of non-finite ones (for a gradient
    norm and an overflow check without reading the gradients again); no host synchronisation either way.
    """
    _prepare_unpack(flat, tensors, scale, stats, bind=False)()


def bind_pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> Callable[[], None]:
    """Check and plan :func:`pack` once; the returned callable repeats it for the same tensors with little host work.

    The callable keeps references to the tensors. Rebind when any tensor is reallocated.
    """
    return _prepare_pack(tensors, out, scale, bind=True)


def bind_unpack(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    scale: float = 1.0,
    *,
    stats: Optional[torch.Tensor] = None,
) -> Callable[[], None]:
    """Check and plan :func:`unpack` once; the returned callable repeats it (see :func:`bind_pack`)."""
    return _prepare_unpack(flat, tensors, scale, stats, bind=True)
