"""The plain-torch path for CPU tensors, with the same bits as the Triton kernel.

Triton's interpreter manages a few million elements a second, far too slow for CPU (gloo) training, so CPU tensors
take this path unless ``TRITON_INTERPRET=1``. torch's float32 -> bfloat16/float16 conversion already rounds to
nearest even, subnormals and overflow included; only NaN differs between torch's own code paths, so NaNs are
rewritten to the kernel's canonical quiet NaN (unless the caller takes any NaN). A scaled conversion to or from a 16-bit
dtype multiplies in float32 in a scratch buffer and converts with torch's vectorised copy (``_scaled``). Each
operation is one function, ``pack_pass`` and ``unpack_pass``: the pass over the tensors it is given, its views and
scratch made once, as a call that a plain call runs once and a prepared call repeats while its tensors stay.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import torch

from .convert import NAN_BITS
from .dtypes import BITS_DTYPE, OUT_KIND


#: Elements per step of a conversion through a float32 scratch buffer: 1 MiB of float32, which stays in a core's
#: L2 cache between the product and the rounding, and bounds the scratch a pass holds.
CHUNK = 1 << 18


def _scaled(dst: torch.Tensor, src: torch.Tensor, scale: float) -> Callable[[], None]:
    """A call doing dst <- round(src * scale): the product in float32, rounded once into dst's dtype.

    torch's ``mul(src, scale, out=dst)`` with a 16-bit dst takes about 1.4x a float32 multiply and a vectorised
    conversion through a scratch buffer that stays in cache (0.34 against 0.24 ns an element, one thread, here); with
    a 16-bit src it would round the product to src's dtype first, and ``src.float()`` allocates at every call. So a
    16-bit dst goes through a float32 scratch buffer, chunk by chunk, and a 16-bit src is widened into dst.
    """
    if src.dtype == torch.float32 and dst.dtype == torch.float32:
        return lambda: torch.mul(src, scale, out=dst)
    if dst.dtype == torch.float32:  # a 16-bit src: widen into dst (exact), multiply there
        def widen_then_scale() -> None:
            dst.copy_(src)
            dst.mul_(scale)

        return widen_then_scale
    scratch = torch.empty(min(dst.numel(), CHUNK), dtype=torch.float32, device=dst.device)
    steps = []
    for start in range(0, dst.numel(), CHUNK):
        end = min(start + CHUNK, dst.numel())
        steps.append((dst[start:end], src[start:end], scratch[: end - start]))
    wide = src.dtype == torch.float32

    def through_scratch() -> None:
        for d, s, tmp in steps:
            if wide:
                torch.mul(s, scale, out=tmp)
            else:
                tmp.copy_(s)
                tmp.mul_(scale)
            d.copy_(tmp)

    return through_scratch


def _converter(dst: torch.Tensor, src: torch.Tensor, scale: float, canonical_nan: bool = True) -> Callable[[], None]:
    """A call doing dst <- round(src * scale) with one rounding (NaNs canonical unless told not to). Both 1-D, same
    length; the views and scratch are made once, here."""
    if scale == 1.0:
        def convert() -> None:
            dst.copy_(src)
    else:
        convert = _scaled(dst, src, scale)
    if not canonical_nan:
        return convert
    bits, nan_bits = dst.view(BITS_DTYPE[dst.dtype]), NAN_BITS[OUT_KIND[dst.dtype]]

    def convert_canonical() -> None:
        convert()
        # A NaN anywhere makes the sum NaN: one read of dst, and the exact search only when it fires.
        if math.isnan(dst.sum().item()):
            bits[torch.isnan(dst)] = nan_bits

    return convert_canonical


def _accumulate_stats(stats: torch.Tensor, values: torch.Tensor) -> None:
    v = values.float()
    stats[0] += v.square().sum()
    stats[1] += (~torch.isfinite(v)).sum()


def pack_pass(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float,
              canonical_nan: bool = True) -> Callable[[], None]:
    """out <- concat(flatten(t)) * scale, rounded once to out.dtype (NaNs canonical unless told not to)."""
    return _in_turn(_steps([(out[p:p + t.numel()], t.reshape(-1)) for t, p in _positions(tensors)], scale,
                           canonical_nan))


def unpack_pass(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float, stats: Optional[torch.Tensor],
                canonical_nan: bool = True) -> Callable[[], None]:
    """Each tensor <- its slice of flat * scale, rounded once to its dtype; with ``stats``, [sum of squares,
    non-finite count] of the values stored."""
    pairs = [(t.view(-1), flat[p:p + t.numel()]) for t, p in _positions(tensors)]
    steps = _steps(pairs, scale, canonical_nan)
    if stats is None:
        return _in_turn(steps)
    written = [dst for dst, _ in pairs]

    def with_stats() -> None:
        stats.zero_()
        for step, dst in zip(steps, written):
            step()
            _accumulate_stats(stats, dst)

    return with_stats


def _positions(tensors: Sequence[torch.Tensor]) -> List[tuple]:
    """(tensor, its offset in the flat buffer) of every non-empty tensor."""
    out, position = [], 0
    for t in tensors:
        if t.numel():
            out.append((t, position))
        position += t.numel()
    return out


def _steps(pairs: List[tuple], scale: float, canonical_nan: bool) -> List[Callable[[], None]]:
    return [_converter(dst, src, scale, canonical_nan) for dst, src in pairs]


def _in_turn(steps: List[Callable[[], None]]) -> Callable[[], None]:
    """One call running ``steps`` in order (the step itself when there is one)."""
    if len(steps) == 1:
        return steps[0]

    def run() -> None:
        for step in steps:
            step()

    return run
