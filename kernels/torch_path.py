"""The plain-torch path for CPU tensors, with the same bits as the Triton kernel.

Triton's interpreter manages a few million elements a second, far too slow for CPU (gloo) training, so CPU tensors
take this path unless ``TRITON_INTERPRET=1``. torch's float32 -> bfloat16/float16 conversion already rounds to
nearest even, subnormals and overflow included; only NaN differs between torch's own code paths, so NaNs are
rewritten to the kernel's canonical quiet NaN.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .convert import NAN_BITS
from .dtypes import BITS_DTYPE, OUT_KIND


def _convert_into(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """dst <- round(src * scale) with one rounding; NaNs canonical. Both 1-D, same length."""
    if scale == 1.0:
        dst.copy_(src)
    else:
        # float32 product, rounded once when stored into dst (a 16-bit src would round its product to its own
        # dtype first, so it is widened before the multiply)
        torch.mul(src if src.dtype == torch.float32 else src.float(), scale, out=dst)
    # A NaN anywhere makes the sum NaN; the sum is one cheap pass, the exact search runs only when it fires.
    if bool(torch.isnan(dst.sum())):
        nan = torch.isnan(dst)
        dst.view(BITS_DTYPE[dst.dtype])[nan] = NAN_BITS[OUT_KIND[dst.dtype]]


def _accumulate_stats(stats: torch.Tensor, values: torch.Tensor) -> None:
    v = values.float()
    stats[0] += v.square().sum()
    stats[1] += (~torch.isfinite(v)).sum()


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    """out <- concat(flatten(t)) * scale, rounded once to out.dtype."""
    position = 0
    for t in tensors:
        n = t.numel()
        if n:
            _convert_into(out[position : position + n], t.reshape(-1), scale)
        position += n


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float, stats: Optional[torch.Tensor]) -> None:
    """Each tensor <- its slice of flat * scale, rounded once to its dtype; optional [sum of squares, non-finite]."""
    if stats is not None:
        stats.zero_()
    position = 0
    for t in tensors:
        n = t.numel()
        if n:
            dst = t.view(-1)
            _convert_into(dst, flat[position : position + n], scale)
            if stats is not None:
                _accumulate_stats(stats, dst)
        position += n
