"""The plain-torch path of the wire-format kernels (block-scaled FP8, summing slices in float32), same bits.

CPU tensors take this path unless ``TRITON_INTERPRET=1`` (the interpreter is far too slow for training); the tests
check that both give identical bits. Every float32 operation here is the one the kernel does, in the same order:
scale, add the residual, choose the block's power-of-two scale, round, and sum the ranks' blocks in rank order.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .blocks import BlockLayout
from .fp8 import BLOCK_ELEMENTS, MAX_EXPONENT, MIN_EXPONENT, NAN_CODE, ROW_BYTES, ROW_WORDS, Fp8Format
from .torch_path import _accumulate_stats, _convert_into


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    return ((exponent + 127) << 23).to(torch.int32).view(torch.float32)


def quantize_rows(values: torch.Tensor, fmt: Fp8Format) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 (R, 128), scales float32 (R,), dequantized float32 (R, 128), finite bool (R,)) of float32 rows."""
    magnitude = values.view(torch.int32) & 0x7FFFFFFF
    largest = magnitude.amax(dim=1)
    finite = largest < 0x7F800000
    exponent = (largest >> 23) - 127 - fmt.max_exponent + ((largest & 0x7FFFFF) > 0x600000).to(torch.int32)
    exponent = exponent.clamp(MIN_EXPONENT, MAX_EXPONENT).masked_fill(~finite, 0)
    codes = (values * _power_of_two(-exponent)[:, None]).to(fmt.dtype).view(torch.uint8)
    codes[~finite] = NAN_CODE
    scales = _power_of_two(exponent)
    return codes, scales, decode_rows(codes, scales, fmt), finite


def decode_rows(codes: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """float32 (R, 128): each row's codes times its scale."""
    return codes.view(fmt.dtype).float() * scales[:, None]


def _split_rows(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes (R, 128) uint8, scales (R,) float32) views of a flat uint8 row buffer."""
    grid = rows.view(-1, ROW_BYTES)
    return grid[:, :BLOCK_ELEMENTS], rows.view(torch.int32).view(-1, ROW_WORDS)[:, -1].view(torch.float32)


def _write_rows(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    out_codes, out_scales = _split_rows(rows)
    out_codes.copy_(codes)
    out_scales.copy_(scales)


def quantize_blocks(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float, fmt: Fp8Format,
                    residual: Optional[torch.Tensor]) -> None:
    """rows <- the blocks of ``src * scale (+ residual)``; residual <- what the rounding left out."""
    x = src.float()
    if scale != 1.0:
        x = x * scale
    if residual is not None:
        x = x + residual
    positions = layout.positions()
    grid = torch.zeros(layout.n_rows * BLOCK_ELEMENTS, dtype=torch.float32, device=src.device)
    grid.index_copy_(0, positions, x)  # index_copy_/index_select: torch's x[index] is ~300x slower on CPU
    values = grid.view(layout.n_rows, BLOCK_ELEMENTS)
    codes, scales, dequantized, finite = quantize_rows(values, fmt)
    _write_rows(rows, codes, scales)
    if residual is not None:
        left = (values - dequantized).masked_fill(~finite[:, None], 0.0)
        residual.copy_(left.view(-1).index_select(0, positions))


def reduce_blocks(received: torch.Tensor, n_ranks: int, out_rows: torch.Tensor, fmt: Fp8Format,
                  residual: Optional[torch.Tensor]) -> None:
    """out_rows <- the requantized sum, in float32 and rank order, of the ranks' copies of this shard's rows."""
    codes, scales = _split_rows(received)
    per_rank = codes.shape[0] // n_ranks
    total = torch.zeros(per_rank, BLOCK_ELEMENTS, dtype=torch.float32, device=received.device)
    for rank in range(n_ranks):
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        total = total + decode_rows(codes[part], scales[part], fmt)
    values = total if residual is None else total + residual.view(per_rank, BLOCK_ELEMENTS)
    out_codes, out_scales, dequantized, finite = quantize_rows(values, fmt)
    _write_rows(out_rows, out_codes, out_scales)
    if residual is not None:
        residual.view(per_rank, BLOCK_ELEMENTS).copy_((values - dequantized).masked_fill(~finite[:, None], 0.0))


def dequantize_blocks(rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor, fmt: Fp8Format,
                      stats: Optional[torch.Tensor]) -> None:
    """dst <- the blocks' values, rounded once to dst's dtype (NaNs canonical); optional [sum of squares, non-finite]."""
    codes, scales = _split_rows(rows)
    values = decode_rows(codes, scales, fmt).view(-1).index_select(0, layout.positions())
    _convert_into(dst, values, 1.0)
    if stats is not None:
        stats.zero_()
        _accumulate_stats(stats, dst)


def sum_slices(received: torch.Tensor, n_ranks: int, out: torch.Tensor) -> None:
    """out <- the sum of the ``n_ranks`` equal slices of ``received``, in float32 and rank order, rounded once."""
    size = out.numel()
    total = torch.zeros(size, dtype=torch.float32, device=out.device)
    for rank in range(n_ranks):
        total = total + received[rank * size : (rank + 1) * size].float()
    _convert_into(out, total, 1.0)
