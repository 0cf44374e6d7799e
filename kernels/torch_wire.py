"""The plain-torch path of the wire-format kernels (block-scaled FP8, summing slices in float32), same bits.

CPU tensors take this path unless ``TRITON_INTERPRET=1`` (the interpreter is far too slow for training); the tests
check that both give identical bits. Every float32 operation here is the one the kernel does, in the same order:
scale, add the residual, choose the block's power-of-two scale, round, and sum the ranks' blocks in rank order.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .blocks import BlockLayout
from .fp8 import BLOCK_ELEMENTS, MAX_EXPONENT, MIN_EXPONENT, NAN_CODE, ROW_BYTES, ROW_WORDS, Fp8Format
from .torch_path import _accumulate_stats, _converter


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


# ---- bound forms: views, scratch buffers and branches decided once, no allocation per call -------------------------


class _Decoder:
    """FP8 codes (R, 128) -> their float32 values, unscaled. torch's own conversion of E4M3 to float32 is element by
    element on CPUs (about 3 ns an element); a table of the 256 values, read through int32 indices, takes a third of
    that. E5M2 converts fast as it is (it is a truncated float16)."""

    def __init__(self, fmt: Fp8Format, n_rows: int, device: torch.device) -> None:
        self.fmt = fmt
        if fmt.dtype == torch.float8_e4m3fn:
            self.table = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float().to(device)
            self.index = torch.empty(n_rows, BLOCK_ELEMENTS, dtype=torch.int32, device=device)
        else:
            self.table = None

    def __call__(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (R, 128) float32 <- the values of ``codes`` (R, 128) uint8 (any strides)."""
        if self.table is None:
            out.copy_(codes.view(self.fmt.dtype))
            return
        self.index.copy_(codes)
        torch.index_select(self.table, 0, self.index.view(-1), out=out.view(-1))


class _RowQuantizer:
    """Quantizes float32 rows of 128 into FP8 codes and power-of-two scales, as ``quantize_rows``, into a row
    buffer's views; optionally writes what the rounding left out. Its scratch is one (R, 128) float32 buffer."""

    def __init__(self, fmt: Fp8Format, n_rows: int, device: torch.device) -> None:
        self.fmt = fmt
        self.scratch = torch.empty(n_rows, BLOCK_ELEMENTS, dtype=torch.float32, device=device)
        self.largest = torch.empty(n_rows, dtype=torch.int32, device=device)
        self.decode = _Decoder(fmt, n_rows, device)

    def __call__(self, values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 left: Optional[torch.Tensor] = None) -> None:
        """``codes`` (R, 128) uint8 and ``scales`` (R,) float32 <- ``values`` (R, 128) float32 quantized; ``left``
        (R, 128) float32, if given, <- values minus what the codes stand for (0 in a non-finite block)."""
        fmt, scratch, largest = self.fmt, self.scratch, self.largest
        magnitude = scratch.view(torch.int32)
        torch.bitwise_and(values.view(torch.int32), 0x7FFFFFFF, out=magnitude)
        torch.amax(magnitude, dim=1, out=largest)
        finite = largest < 0x7F800000
        exponent = (largest >> 23) - 127 - fmt.max_exponent + ((largest & 0x7FFFFF) > 0x600000).to(torch.int32)
        exponent = exponent.clamp(MIN_EXPONENT, MAX_EXPONENT).masked_fill(~finite, 0)
        # The float32 product, then torch's rounding to FP8 in a vectorised copy (a mul with an FP8 out is 3x slower).
        torch.mul(values, _power_of_two(-exponent)[:, None], out=scratch)
        codes.view(fmt.dtype).copy_(scratch)
        all_finite = bool(finite.all())
        if not all_finite:
            codes[~finite] = NAN_CODE
        scale = _power_of_two(exponent)
        scales.copy_(scale)
        if left is None:
            return
        self.decode(codes, scratch)
        # values - code * scale: the product is exact (a power-of-two scale), so one rounding with or without FMA.
        torch.addcmul(values, scratch, scale.neg()[:, None], out=left)
        if not all_finite:
            left[~finite] = 0.0


def _aligned(layout: BlockLayout) -> bool:
    """Whether every element sits at its own flat offset in the block grid (every tensor but the last a whole number
    of blocks): then the grid is the bucket itself, followed by zeros, with no scatter or gather."""
    return layout.n_blocks == -(-layout.n_elements // BLOCK_ELEMENTS) and all(
        size % BLOCK_ELEMENTS == 0 for size in layout.sizes[:-1])


def bind_quantize_blocks(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float, fmt: Fp8Format,
                         residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """rows <- the blocks of ``src * scale (+ residual)``; residual <- what the rounding left out. Bound: the
    buffers are made here, a call allocates nothing."""
    n, device = layout.n_elements, src.device
    grid = torch.zeros(layout.n_rows, BLOCK_ELEMENTS, dtype=torch.float32, device=device)
    aligned = _aligned(layout)
    x = grid.view(-1)[:n] if aligned else torch.empty(n, dtype=torch.float32, device=device)
    positions = None if aligned else layout.positions().to(device)
    codes, scales = _split_rows(rows)
    quantize = _RowQuantizer(fmt, layout.n_rows, device)
    left = None if residual is None else torch.empty_like(grid)
    left_x = None if left is None else (left.view(-1)[:n] if aligned else None)
    widen = src.dtype != torch.float32

    def run() -> None:
        if widen:  # the kernel widens, then multiplies in float32
            x.copy_(src)
            if scale != 1.0:
                x.mul_(scale)
        elif scale != 1.0:
            torch.mul(src, scale, out=x)
        else:
            x.copy_(src)
        if residual is not None:
            x.add_(residual)
        if positions is not None:
            grid.view(-1).index_copy_(0, positions, x)  # the padding of short blocks stays zero
        quantize(grid, codes, scales, left)
        if residual is not None:
            if left_x is not None:
                residual.copy_(left_x)
            else:
                torch.index_select(left.view(-1), 0, positions, out=residual)

    return run


def bind_reduce_blocks(received: torch.Tensor, n_ranks: int, out_rows: torch.Tensor, fmt: Fp8Format,
                       residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """out_rows <- the requantized sum, in float32 and rank order, of the ranks' copies of this shard's rows (+ the
    residual); residual <- what the rounding left out. Bound: a call allocates nothing."""
    codes, scales = _split_rows(received)
    per_rank = codes.shape[0] // n_ranks
    parts = [(codes[r * per_rank:(r + 1) * per_rank], scales[r * per_rank:(r + 1) * per_rank, None])
             for r in range(n_ranks)]
    out_codes, out_scales = _split_rows(out_rows)
    total = torch.empty(per_rank, BLOCK_ELEMENTS, dtype=torch.float32, device=received.device)
    decoded = torch.empty_like(total)
    decode = _Decoder(fmt, per_rank, received.device)
    quantize = _RowQuantizer(fmt, per_rank, received.device)
    grid_residual = None if residual is None else residual.view(per_rank, BLOCK_ELEMENTS)

    def run() -> None:
        total.zero_()  # the kernel's sum starts at +0.0, so a -0.0 from every rank sums to +0.0
        for part_codes, part_scales in parts:
            decode(part_codes, decoded)
            torch.addcmul(total, decoded, part_scales, out=total)  # an exact product, one rounding: as the kernel
        if grid_residual is not None:
            total.add_(grid_residual)
        quantize(total, out_codes, out_scales, grid_residual)

    return run


def bind_dequantize_blocks(rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor, fmt: Fp8Format,
                           stats: Optional[torch.Tensor], canonical_nan: bool = True) -> Callable[[], None]:
    """dst <- the blocks' values, rounded once to dst's dtype (NaNs canonical unless told not to); optional
    [sum of squares, non-finite count]. Bound: a call allocates nothing."""
    n, device = layout.n_elements, dst.device
    codes, scales = _split_rows(rows)
    decode = _Decoder(fmt, layout.n_rows, device)
    values = torch.empty(layout.n_rows, BLOCK_ELEMENTS, dtype=torch.float32, device=device)
    aligned = _aligned(layout)
    positions = None if aligned else layout.positions().to(device)
    flat = values.view(-1)[:n] if aligned else torch.empty(n, dtype=torch.float32, device=device)
    store = _converter(dst, flat, 1.0, canonical_nan)

    def run() -> None:
        decode(codes, values)
        values.mul_(scales[:, None])
        if positions is not None:
            torch.index_select(values.view(-1), 0, positions, out=flat)
        store()
        if stats is not None:
            stats.zero_()
            _accumulate_stats(stats, dst)

    return run


# ---- plain calls: the bound form, made and run once -------------------------------------------------------------


def quantize_blocks(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float, fmt: Fp8Format,
                    residual: Optional[torch.Tensor]) -> None:
    """rows <- the blocks of ``src * scale (+ residual)``; residual <- what the rounding left out."""
    bind_quantize_blocks(src, layout, rows, scale, fmt, residual)()


def reduce_blocks(received: torch.Tensor, n_ranks: int, out_rows: torch.Tensor, fmt: Fp8Format,
                  residual: Optional[torch.Tensor]) -> None:
    """out_rows <- the requantized sum, in float32 and rank order, of the ranks' copies of this shard's rows."""
    bind_reduce_blocks(received, n_ranks, out_rows, fmt, residual)()


def dequantize_blocks(rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor, fmt: Fp8Format,
                      stats: Optional[torch.Tensor]) -> None:
    """dst <- the blocks' values, rounded once to dst's dtype (NaNs canonical); optional [sum of squares, non-finite]."""
    bind_dequantize_blocks(rows, layout, dst, fmt, stats)()


def bind_sum_slices(received: torch.Tensor, n_ranks: int, out: torch.Tensor,
                    canonical_nan: bool = True) -> Callable[[], None]:
    """out <- the sum of the ``n_ranks`` equal slices of ``received``, in float32 and rank order, rounded once.
    Bound: a call allocates nothing."""
    size = out.numel()
    parts = [received[r * size:(r + 1) * size] for r in range(n_ranks)]
    total = torch.empty(size, dtype=torch.float32, device=out.device)
    store = _converter(out, total, 1.0, canonical_nan)

    def run() -> None:
        total.zero_()  # the kernel's sum starts at +0.0, so a -0.0 from every rank sums to +0.0
        for part in parts:
            total.add_(part)  # a 16-bit part is widened exactly, then added in float32
        store()

    return run


def sum_slices(received: torch.Tensor, n_ranks: int, out: torch.Tensor) -> None:
    """out <- the sum of the ``n_ranks`` equal slices of ``received``, in float32 and rank order, rounded once."""
    bind_sum_slices(received, n_ranks, out)()
