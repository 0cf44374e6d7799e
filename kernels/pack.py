"""pack and unpack: the typed launchers around the conversion kernels.

``pack`` flattens a list of tensors into one buffer, scaling and casting on the way (the step before an
all-reduce); ``unpack`` is the way back. Both take one pass over the data whatever the number of tensors: one launch
on CUDA, the same kernel in Triton's interpreter for CPU tensors when ``TRITON_INTERPRET=1``, and otherwise the torch
path for CPU tensors, all with the same bits. A plain call checks its inputs once per layout (``layouts.py``): a
repeat call with the same tensors goes straight to the launch. ``bind_pack``/``bind_unpack`` check and plan once and
return a launch to replay, for callers (the DDP hook) that repeat the same layout every step.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from . import _triton, torch_path
from .dtypes import BITS_DTYPE, OUT_KIND
from .launch import (BoundLaunch, KernelCall, PreparedCall, direct_launch, kernel_arguments, launch,
                     launch_hooks_installed)
from .layouts import LayoutCache, signature
from .validation import check_flat, check_overlap, check_scale, check_stats, check_tensor_list
from .worklist import PLANS, Plan, build_plan


Layout = Callable[[Sequence[torch.Tensor], torch.Tensor, Optional[torch.Tensor]], None]
"""A checked plain call, replayed as ``layout(tensors, flat, stats)`` for any call with the same signature (``out``
is the flat side of a pack). It holds no tensor of the caller's: each call passes its own."""

LAYOUTS = LayoutCache()


def uses_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through the Triton kernel (CUDA, or CPU under the interpreter)."""
    if not _triton.AVAILABLE:
        return False
    return device.type == "cuda" or (device.type == "cpu" and _triton.INTERPRETER)


def _check_pack(tensors, out, scale) -> Tuple[List[torch.Tensor], float, bool]:
    """(tensors as a list, scale as a float, whether there is nothing to do) after every check of a pack."""
    tensors = check_tensor_list(tensors, "tensors")
    scale = check_scale(scale)
    check_flat(out, "out", sum(t.numel() for t in tensors), tensors)
    in_place = check_overlap(tensors, out, "out", tensors_written=False)
    return tensors, scale, (in_place and scale == 1.0) or out.numel() == 0


def _check_unpack(flat, tensors, scale, stats) -> Tuple[List[torch.Tensor], float, bool]:
    """As :func:`_check_pack`, for an unpack; with stats there is always something to do (zero them at least)."""
    tensors = check_tensor_list(tensors, "tensors")
    scale = check_scale(scale)
    check_flat(flat, "flat", sum(t.numel() for t in tensors), tensors)
    check_stats(stats, flat.device)
    in_place = check_overlap(tensors, flat, "flat", tensors_written=True)
    return tensors, scale, (in_place and scale == 1.0 and stats is None) or flat.numel() == 0


def _nothing_to_do(tensors, flat, stats) -> None:
    if stats is not None:
        stats.zero_()


# ---- plain calls: a launch per layout that holds no tensors -------------------------------------------------------


class _KernelLayout:
    """A checked layout's kernel launch: the direct launch when the layout is kept (a repeat call replays it), else
    Triton's launcher with each call's own tensors (``arguments(tensors, flat, stats)`` gives a call's kernel, args
    and constexprs). With stats, the per-block partial sums go to ``partials``, a buffer of the layout's own: two
    calls could only share it by writing the same tensors at once, a race of the caller's."""

    __slots__ = ("plan", "arguments", "partials", "direct")

    def __init__(self, plan: Plan, arguments: Callable[..., tuple], first: Optional[tuple],
                 partials: Optional[torch.Tensor] = None) -> None:
        self.plan, self.arguments, self.partials = plan, arguments, partials
        self.direct = direct_launch(plan, *first) if first is not None else None

    def __call__(self, tensors, flat, stats) -> None:
        if self.direct is not None and not launch_hooks_installed():  # a profiler sees only Triton's launcher
            self.direct()
        else:
            launch(self.plan, *self.arguments(tensors, flat, stats))
        if self.partials is not None:
            torch.sum(self.partials, dim=0, out=stats)


def _pack_layout(tensors, out, scale, kept: bool) -> Tuple[Layout, List[torch.Tensor]]:
    """Check a plain pack and prepare its launch (a direct one where the layout is ``kept`` for repeat calls); also
    the tensors as the checked list."""
    tensors, scale, nothing = _check_pack(tensors, out, scale)
    if nothing:
        return _nothing_to_do, tensors
    if not uses_triton(out.device):
        return (lambda ts, flat, stats: torch_path.pack(ts, flat, scale)), tensors
    plan = PLANS.get(tensors, out, tensors_are_source=True)
    kind, bits = OUT_KIND[out.dtype], BITS_DTYPE[out.dtype]

    def arguments(ts, flat, stats) -> tuple:
        return kernel_arguments(plan, ts[plan.base_index], flat.view(bits), scale, kind, None)

    return _KernelLayout(plan, arguments, arguments(tensors, out, None) if kept else None), tensors


def _unpack_layout(flat, tensors, scale, stats, kept: bool) -> Tuple[Layout, List[torch.Tensor]]:
    """Check a plain unpack and prepare its launch (see :func:`_pack_layout`); also the tensors as the checked list."""
    tensors, scale, nothing = _check_unpack(flat, tensors, scale, stats)
    if nothing:
        return _nothing_to_do, tensors
    if not uses_triton(flat.device):
        return (lambda ts, fl, st: torch_path.unpack(fl, ts, scale, st)), tensors
    plan = PLANS.get(tensors, flat, tensors_are_source=False)
    base = tensors[plan.base_index]
    kind, bits = OUT_KIND[base.dtype], BITS_DTYPE[base.dtype]
    partials = None if stats is None else torch.empty((plan.n_items, 2), dtype=torch.float32, device=flat.device)

    def arguments(ts, fl, st) -> tuple:
        return kernel_arguments(plan, fl, ts[plan.base_index].view(bits), scale, kind, partials)

    first = arguments(tensors, flat, stats) if kept else None
    return _KernelLayout(plan, arguments, first, partials), tensors


# ---- public API ---------------------------------------------------------------------------------------------------


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Write ``concat(t.flatten() for t in tensors) * scale`` into ``out``, rounded once to ``out.dtype``.

    Bit-for-bit ``torch.cat([t.flatten().float() for t in tensors]).mul(scale).to(out.dtype)``, except that every
    NaN is written as the canonical quiet NaN of ``out.dtype``. Tensors share one dtype and device (float32,
    bfloat16 or float16) and must be contiguous; ``out`` is a contiguous 1-D tensor of the total size, of any of the
    three dtypes. ``out`` may be the very same memory as the tensors (in-place scaling); any other overlap is refused.
    Returns ``out``.
    """
    sig = signature("pack", tensors, out, scale)
    layout = LAYOUTS.get(sig) if sig is not None else None
    if layout is None:
        layout, tensors = _pack_layout(tensors, out, scale, kept=sig is not None)
        if sig is not None:
            LAYOUTS.put(sig, layout)
    layout(tensors, out, None)
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
    sig = signature("unpack" if stats is None else "unpack+stats", tensors, flat, scale)
    layout = LAYOUTS.get(sig) if sig is not None else None
    if layout is None:
        layout, tensors = _unpack_layout(flat, tensors, scale, stats, kept=sig is not None)
        if sig is not None:
            LAYOUTS.put(sig, layout)
    elif stats is not None:
        check_stats(stats, flat.device)  # not part of the layout: a stats tensor is checked at every call
    layout(tensors, flat, stats)


def bind_pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0, *,
              canonical_nan: bool = True) -> Callable[[], None]:
    """Check and plan :func:`pack` once; the returned callable repeats it for the same tensors with little host work.

    The callable keeps references to the tensors. Rebind when any tensor is reallocated. ``canonical_nan=False``
    lets the torch path (CPU tensors) skip the pass that makes NaNs canonical, for callers to whom a NaN is a NaN
    (the hook: NCCL's and gloo's sums make NaNs of their own anyway): a NaN then keeps the bits torch's conversion
    gives it, every other value the same bits. The kernel always writes them canonical, at no cost.
    """
    tensors, scale, nothing = _check_pack(tensors, out, scale)
    if nothing:
        return lambda: None
    if not uses_triton(out.device):
        return torch_path.bind_pack(tensors, out, scale, canonical_nan)
    plan = PLANS.get(tensors, out, tensors_are_source=True)
    args = kernel_arguments(plan, tensors[plan.base_index], out.view(BITS_DTYPE[out.dtype]), scale,
                            OUT_KIND[out.dtype], None)
    return BoundLaunch(plan, *args, keepalive=tensors)


def bind_unpack(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    scale: float = 1.0,
    *,
    stats: Optional[torch.Tensor] = None,
    canonical_nan: bool = True,
) -> Callable[[], None]:
    """Check and plan :func:`unpack` once; the returned callable repeats it (see :func:`bind_pack`, also for
    ``canonical_nan``)."""
    tensors, scale, nothing = _check_unpack(flat, tensors, scale, stats)
    if nothing:
        return stats.zero_ if stats is not None else (lambda: None)
    if not uses_triton(flat.device):
        return torch_path.bind_unpack(flat, tensors, scale, stats, canonical_nan)
    plan = PLANS.get(tensors, flat, tensors_are_source=False)
    base = tensors[plan.base_index]
    dst = base.view(BITS_DTYPE[base.dtype])
    if stats is None:
        args = kernel_arguments(plan, flat, dst, scale, OUT_KIND[base.dtype], None)
        return BoundLaunch(plan, *args, keepalive=tensors)

    partials = torch.empty((plan.n_items, 2), dtype=torch.float32, device=flat.device)
    kernel_launch = BoundLaunch(plan, *kernel_arguments(plan, flat, dst, scale, OUT_KIND[base.dtype], partials),
                                keepalive=tensors)

    def run_with_stats() -> None:
        kernel_launch()
        torch.sum(partials, dim=0, out=stats)

    return run_with_stats


# ---- prepared: one tensor, checked and compiled once, run on the tensors each call passes --------------------------


def _one_tensor_call(tensor: torch.Tensor, flat: torch.Tensor, scale: float, packing: bool, canonical_nan: bool,
                     checked: bool) -> KernelCall:
    """A pack of ``tensor`` into ``flat`` (or, not ``packing``, an unpack of ``flat`` into it) as a KernelCall."""
    if checked:
        if packing:
            _check_pack([tensor], flat, scale)
        else:
            _check_unpack(flat, [tensor], scale, None)
    if flat.numel() == 0:
        return KernelCall(torch_path=lambda: None)
    if not uses_triton(flat.device):
        return KernelCall(torch_path=torch_path.bind_pack([tensor], flat, scale, canonical_nan) if packing
                          else torch_path.bind_unpack(flat, [tensor], scale, None, canonical_nan))
    plan = build_plan([tensor], flat, packing, flat.device)  # one run: no table, nothing copied to the device
    if packing:
        args = kernel_arguments(plan, tensor, flat.view(BITS_DTYPE[flat.dtype]), scale, OUT_KIND[flat.dtype], None)
    else:
        args = kernel_arguments(plan, flat, tensor.view(BITS_DTYPE[tensor.dtype]), scale, OUT_KIND[tensor.dtype],
                                None)
    return KernelCall(launch=(plan, *args))


def prepare_pack(tensor: torch.Tensor, out: torch.Tensor, scale: float = 1.0, *,
                 canonical_nan: bool = True) -> PreparedCall:
    """Check :func:`pack` of one tensor once for tensors like these; the returned call runs it on the tensors each
    call passes, ``call(tensor, out)``, with a bound launch's host work and without holding them
    (:class:`~.launch.PreparedCall`: for buffers allocated anew at every call; ``canonical_nan`` as for
    :func:`bind_pack`). The two must not share memory."""
    scale = check_scale(scale)
    return PreparedCall(lambda t, o, checked: _one_tensor_call(t, o, scale, True, canonical_nan, checked),
                        ("tensor", "out"), (tensor, out))


def prepare_unpack(flat: torch.Tensor, tensor: torch.Tensor, scale: float = 1.0, *,
                   canonical_nan: bool = True) -> PreparedCall:
    """:func:`unpack` of ``flat`` into one tensor (without statistics) prepared as :func:`prepare_pack` is:
    ``call(flat, tensor)``."""
    scale = check_scale(scale)
    return PreparedCall(lambda f, t, checked: _one_tensor_call(t, f, scale, False, canonical_nan, checked),
                        ("flat", "tensor"), (flat, tensor))
