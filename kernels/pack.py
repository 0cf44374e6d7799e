"""pack and unpack: the typed launchers around the conversion kernels.

``pack`` flattens a list of tensors into one buffer, scaling and casting on the way (the step before an
all-reduce); ``unpack`` is the way back. Both take one pass over the data whatever the number of tensors: one launch
on CUDA, the same kernel in Triton's interpreter for CPU tensors when ``TRITON_INTERPRET=1``, and otherwise the torch
path for CPU tensors, all with the same bits. Each has two forms: the plain call, checked in full the first time it
meets a layout, which it then keeps (``plain_calls.py``: a repeat costs about a prepared call's relaunch), and
``pack.prepare(...)``/``unpack.prepare(...)``, checked once and run on the tensors each call passes (``prepared.py``:
for callers that repeat it every step, the DDP hook's buckets).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from . import _triton, torch_path
from .dtypes import BITS_DTYPE, OUT_KIND
from .launch import KernelCall, kernel_arguments, run_call
from .plain_calls import PlainCalls
from .prepared import PreparedCall, with_prepare
from .validation import check_flat, check_overlap, check_scale, check_stats, check_tensor_list
from .worklist import build_plan


def uses_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through the Triton kernel (CUDA, or CPU under the interpreter)."""
    if not _triton.AVAILABLE:
        return False
    return device.type == "cuda" or (device.type == "cpu" and _triton.INTERPRETER)


def _nothing() -> None:
    return None


def _pack_call(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float, canonical_nan: bool,
               checked: bool) -> KernelCall:
    """A pack of ``tensors`` into ``out``, after every check where ``checked`` (the overlap check always: it reads
    addresses, which differ from call to call)."""
    if checked:
        tensors = check_tensor_list(tensors, "tensors")
        scale = check_scale(scale)
        check_flat(out, "out", sum(t.numel() for t in tensors), tensors)
    in_place = check_overlap(tensors, out, "out", tensors_written=False)
    if (in_place and scale == 1.0) or out.numel() == 0:
        return KernelCall(torch_path=_nothing)
    if not uses_triton(out.device):
        return KernelCall(torch_path=torch_path.pack_pass(tensors, out, scale, canonical_nan))
    plan = build_plan(tensors, out, True, out.device)
    return KernelCall(launch=(plan, *kernel_arguments(plan, tensors[plan.base_index], out.view(BITS_DTYPE[out.dtype]),
                                                      scale, OUT_KIND[out.dtype], None)))


def _unpack_call(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float, stats: Optional[torch.Tensor],
                 canonical_nan: bool, checked: bool) -> KernelCall:
    """As :func:`_pack_call`, for an unpack; with stats there is always something to do (zero them at least). With
    stats the kernel's per-block partial sums go to a buffer of the call's own, summed behind the kernel."""
    if checked:
        tensors = check_tensor_list(tensors, "tensors")
        scale = check_scale(scale)
        check_flat(flat, "flat", sum(t.numel() for t in tensors), tensors)
        check_stats(stats, flat.device)
    in_place = check_overlap(tensors, flat, "flat", tensors_written=True)
    if (in_place and scale == 1.0 and stats is None) or flat.numel() == 0:
        return KernelCall(torch_path=stats.zero_ if stats is not None else _nothing)
    if not uses_triton(flat.device):
        return KernelCall(torch_path=torch_path.unpack_pass(flat, tensors, scale, stats, canonical_nan))
    plan = build_plan(tensors, flat, False, flat.device)
    base = tensors[plan.base_index]
    partials = None if stats is None else torch.empty((plan.n_items, 2), dtype=torch.float32, device=flat.device)
    args = kernel_arguments(plan, flat, base.view(BITS_DTYPE[base.dtype]), scale, OUT_KIND[base.dtype], partials)
    after = None if stats is None else functools.partial(torch.sum, partials, dim=0, out=stats)
    return KernelCall(launch=(plan, *args), after=after)


def _prepare_pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0, *,
                  canonical_nan: bool = True) -> PreparedCall:
    """:func:`pack` checked once for tensors like these; the returned call runs it on the tensors each call passes,
    ``call(tensors, out)`` (:class:`~.prepared.PreparedCall`; ``tensors`` a list like this one, ``out`` may be the
    very same memory as they are). ``canonical_nan=False`` lets the torch path (CPU tensors) skip the pass that
    makes NaNs canonical, for callers to whom a NaN is a NaN (the hook: NCCL's and gloo's sums make NaNs of their
    own anyway): a NaN then keeps the bits torch's conversion gives it, every other value the same bits. The kernel
    always writes them canonical, at no cost."""
    scale = check_scale(scale)
    return PreparedCall(lambda ts, o, checked: _pack_call(ts, o, scale, canonical_nan, checked), ("tensors", "out"),
                        (tensors, out), disjoint=False)


_PLAIN_PACKS = PlainCalls(("tensors", "out"), flat_first=False)
_PLAIN_UNPACKS = PlainCalls(("flat", "tensors"), flat_first=True)


@with_prepare(_prepare_pack)
def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Write ``concat(t.flatten() for t in tensors) * scale`` into ``out``, rounded once to ``out.dtype``.

    Bit-for-bit ``torch.cat([t.flatten().float() for t in tensors]).mul(scale).to(out.dtype)``, except that every
    NaN is written as the canonical quiet NaN of ``out.dtype``. Tensors share one dtype and device (float32,
    bfloat16 or float16) and must be contiguous; ``out`` is a contiguous 1-D tensor of the total size, of any of the
    three dtypes. ``out`` may be the very same memory as the tensors (in-place scaling); any other overlap is refused.
    Returns ``out``. ``pack.prepare(tensors, out, scale)``: the same, checked once, for calls that repeat it.
    """
    if type(scale) is not float:
        scale = check_scale(scale)  # an int, or a wrong type named; a float's checks are the layout's
    _PLAIN_PACKS.run(("pack", scale.hex()), (tensors, out),
                     lambda ts, o, checked: _pack_call(ts, o, scale, True, checked))
    return out


def _prepare_unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0, *,
                    stats: Optional[torch.Tensor] = None, canonical_nan: bool = True) -> PreparedCall:
    """:func:`unpack` prepared as :func:`pack` is (``pack.prepare``): ``call(flat, tensors, stats)``, stats None
    where the example was None."""
    scale = check_scale(scale)
    return PreparedCall(lambda f, ts, st, checked: _unpack_call(f, ts, scale, st, canonical_nan, checked),
                        ("flat", "tensors", "stats"), (flat, tensors, stats), disjoint=False)


@with_prepare(_prepare_unpack)
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
    ``unpack.prepare(flat, tensors, scale, stats=...)``: the same, checked once, for calls that repeat it.
    """
    if stats is not None:  # its partial sums' buffer is the call's own: no layout to keep
        run_call(_unpack_call(flat, tensors, scale, stats, True, checked=True))
        return
    if type(scale) is not float:
        scale = check_scale(scale)
    _PLAIN_UNPACKS.run(("unpack", scale.hex()), (flat, tensors),
                       lambda f, ts, checked: _unpack_call(f, ts, scale, None, True, checked))

