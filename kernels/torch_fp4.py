"""The block-scaled E2M1 passes in torch ops, with the Triton kernels' bits (``fp4.py``): the reference of the compiled
passes (``blockscale_cpu.c``) and the path CPU tensors take where those do not build (``cpu_fp4`` chooses).

The tests check these, the compiled passes and the Triton kernels give identical bits. Every float32
operation is the kernel's, in its order: scale, add the residual, choose each group's power-of-two scale, round to
nearest-even, and sum the ranks' blocks in rank order. Whole rows at a time, no per-element Python. The rounding
gives the kernel's codes (which compare with the midpoints) in fewer torch ops: below 1, ``round(2|v|)`` (ties to
even: 0.25 -> 0, 0.75 -> code 2, 1.0); from 1 on, the float32 bits rounded to one mantissa bit as FP8's encoding does
(a tie carries to the even code). The decoding is a lookup in the 16 values (``index_select``: torch's ``table[codes]``
is ten times slower on CPUs). Each operation is one function with ``cpu_fp8``'s arguments, less the FP8 format,
giving the pass over the tensors it is given as a call.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .blocks import BlockLayout
from .fp4 import CODE_BYTES, GROUP_ELEMENTS, GROUPS, NAN_SCALE, ROW_BYTES, VALUES
from .fp8 import BLOCK_ELEMENTS, MAX_EXPONENT, MIN_EXPONENT
from .torch_path import _converter
from .torch_wire import finish_stats

_CANONICAL_NAN = 0x7FC00000


#: The value of each code 0-15 (8-15: the negatives, code 8 is -0.0).
_TABLE = torch.tensor(list(VALUES) + [-v for v in VALUES], dtype=torch.float32)


def _encode(scaled: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (int64) of float32 values with |v| <= 6 (NaN and inf: any code; the caller replaces them)."""
    bits = scaled.view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    normal = ((magnitude + 0x1FFFFF + ((magnitude >> 22) & 1)) >> 22) - (126 << 1)
    below_one = torch.round(scaled.abs() * 2.0).to(torch.int32)
    return torch.where(magnitude >= 0x3F800000, normal, below_one).bitwise_or_((bits >> 28) & 8).long()


def _lookup(codes: torch.Tensor) -> torch.Tensor:
    """The float32 value of each code, in codes' shape."""
    return torch.index_select(_TABLE, 0, codes.reshape(-1)).view(codes.shape)


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    return ((exponent + 127) << 23).to(torch.int32).view(torch.float32)


def quantize_rows(values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int64 (R, 128), scale bytes int32 (R, groups), dequantized float32 (R, 128), finite bool (R,)) of
    float32 rows (R, 128), contiguous."""
    r = values.shape[0]
    grouped = values.view(r, GROUPS, GROUP_ELEMENTS)
    largest = (grouped.view(torch.int32) & 0x7FFFFFFF).amax(dim=2)
    finite = largest.amax(dim=1) < 0x7F800000 if r else torch.ones(0, dtype=torch.bool)
    exponent = (largest >> 23) - 129 + ((largest & 0x7FFFFF) > 0x400000).to(torch.int32)
    exponent = exponent.clamp(MIN_EXPONENT, MAX_EXPONENT).masked_fill(~finite[:, None], 0)
    scaled = grouped * _power_of_two(-exponent)[:, :, None]
    codes = _encode(scaled)
    codes.masked_fill_(~finite[:, None, None], 0)
    dequantized = _lookup(codes) * _power_of_two(exponent)[:, :, None]
    scale_bytes = (exponent + 127).masked_fill(~finite[:, None], NAN_SCALE)
    return codes.view(r, BLOCK_ELEMENTS), scale_bytes, dequantized.view(r, BLOCK_ELEMENTS), finite


def decode_rows(rows: torch.Tensor) -> torch.Tensor:
    """float32 (R, 128): each row's codes times its group's scale; NaN (0x7FC00000) in a row sent as non-finite."""
    grid = rows.view(-1, ROW_BYTES)
    packed = grid[:, :CODE_BYTES].long()
    codes = torch.stack([packed & 15, packed >> 4], dim=2).view(-1, GROUPS, GROUP_ELEMENTS)
    scale_bytes = grid[:, CODE_BYTES:].to(torch.int32)
    values = _lookup(codes) * (scale_bytes << 23).view(torch.float32)[:, :, None]
    bits = torch.where(scale_bytes[:, :, None] == NAN_SCALE, _CANONICAL_NAN, values.view(torch.int32))
    return bits.view(torch.float32).view(-1, BLOCK_ELEMENTS)


def write_rows(rows: torch.Tensor, codes: torch.Tensor, scale_bytes: torch.Tensor) -> None:
    """The row buffer ``rows`` (uint8, R rows) <- codes (R, 128), two to a byte, then the scale bytes."""
    grid = rows.view(-1, ROW_BYTES)
    grid[:, :CODE_BYTES] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    grid[:, CODE_BYTES:] = scale_bytes.to(torch.uint8)


def _grid(values: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """float32 (n_rows, 128): the bucket's values where the layout puts them, zero elsewhere."""
    grid = torch.zeros(layout.n_rows * BLOCK_ELEMENTS, dtype=torch.float32, device=values.device)
    grid.index_copy_(0, layout.positions(), values)  # index_copy_/index_select: torch's x[index] is slower on CPU
    return grid.view(layout.n_rows, BLOCK_ELEMENTS)


def quantize_pass(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float,
                  residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """rows <- the blocks of ``src * scale (+ residual)``; residual <- what the rounding left out (float32, or
    bfloat16: widened to add, rounded once to store)."""

    def run() -> None:
        x = src.float()  # widened, then multiplied in float32, as the kernel
        if scale != 1.0:
            x = x * scale
        if residual is not None:
            x = x + residual
        grid = _grid(x, layout)
        codes, scale_bytes, dequantized, finite = quantize_rows(grid)
        write_rows(rows, codes, scale_bytes)
        if residual is not None:
            left = (grid - dequantized).masked_fill_(~finite[:, None], 0.0)
            if residual.dtype == torch.float32:
                torch.index_select(left.view(-1), 0, layout.positions(), out=residual)
            else:  # bfloat16: rounded once, to nearest even
                residual.copy_(torch.index_select(left.view(-1), 0, layout.positions()))

    return run


def reduce_pass(received: torch.Tensor, n_ranks: int, out_rows: torch.Tensor,
                residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """out_rows <- the requantized sum, in float32 and rank order from +0, of the ranks' copies of this shard's rows
    (+ the residual, float32 or bfloat16); residual <- what the rounding left out, rounded once where bfloat16."""
    per_rank = out_rows.numel() // ROW_BYTES
    step = per_rank * ROW_BYTES

    def run() -> None:
        total = torch.zeros(per_rank, BLOCK_ELEMENTS, dtype=torch.float32, device=out_rows.device)
        for rank in range(n_ranks):
            total.add_(decode_rows(received[rank * step:(rank + 1) * step]))
        if residual is not None:
            total.add_(residual.view(per_rank, BLOCK_ELEMENTS))
        codes, scale_bytes, dequantized, finite = quantize_rows(total)
        write_rows(out_rows, codes, scale_bytes)
        if residual is not None:
            residual.view(per_rank, BLOCK_ELEMENTS).copy_((total - dequantized).masked_fill_(~finite[:, None], 0.0))

    return run


def dequantize_pass(rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor, stats: Optional[torch.Tensor],
                    canonical_nan: bool = True) -> Callable[[], None]:
    """dst <- the blocks' values, rounded once to dst's dtype (NaNs canonical unless told not to); optional
    [sum of squares, non-finite count]."""

    def run() -> None:
        values = decode_rows(rows).view(-1).index_select(0, layout.positions())
        _converter(dst, values, 1.0, canonical_nan)()
        finish_stats(stats, dst)

    return run


def sum_blocks_pass(received: torch.Tensor, n_ranks: int, layout: BlockLayout,
                    out: torch.Tensor) -> Callable[[], None]:
    """out (float32) <- the values of the ``n_ranks`` row slices of ``received`` summed in float32 in rank order from
    the first rank's, each block where the layout puts it."""
    step = layout.n_rows * ROW_BYTES

    def run() -> None:
        total = decode_rows(received[:step])
        for rank in range(1, n_ranks):
            total = total + decode_rows(received[rank * step:(rank + 1) * step])
        torch.index_select(total.view(-1), 0, layout.positions(), out=out)

    return run
