"""The plain-torch path of the wire-format kernels (block-scaled FP8, summing slices in float32), same bits.

CPU tensors take this path unless ``TRITON_INTERPRET=1`` (the interpreter is far too slow for training); the tests
check that both give identical bits. Every float32 operation here is the one the kernel does, in the same order:
scale, add the residual, choose the block's power-of-two scale, round, and sum the ranks' blocks in rank order.
Each operation is one function (``quantize_pass``, ``reduce_pass``, ``dequantize_pass``, ``sum_blocks_pass``,
``sum_slices_pass``): the pass over the tensors it is given, its views and scratch made once, as a call that a plain
call runs once and a prepared call repeats. The FP8 passes are the reference of the compiled ones (``cpu_fp8.py``),
which CPU tensors take where they build.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

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


# ---- the passes: views, scratch buffers and branches decided once, no allocation per call where aligned ----------

#: Blocks per step of a pass: float32 buffers of 1 MiB, which stay in a core's L2 cache between the passes over
#: them, and bound what a pass holds (a few MiB, whatever the bucket's size).
CHUNK_ROWS = 2048


class _Decoder:
    """FP8 codes (r, 128) -> their float32 values, unscaled. torch's own conversion of E4M3 to float32 is element by
    element on CPUs (about 3 ns an element); a table of the 256 values, read through int32 indices, takes a third of
    that. E5M2 converts fast as it is (it is a truncated float16)."""

    def __init__(self, fmt: Fp8Format, rows: int, device: torch.device) -> None:
        self.fmt = fmt
        if fmt.dtype == torch.float8_e4m3fn:
            self.table = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float().to(device)
            self.index = torch.empty(rows, BLOCK_ELEMENTS, dtype=torch.int32, device=device)
        else:
            self.table = None

    def __call__(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (r, 128) float32 <- the values of ``codes`` (r, 128) uint8 (any strides), r at most ``rows``."""
        if self.table is None:
            out.copy_(codes.view(self.fmt.dtype))
            return
        index = self.index[: codes.shape[0]]
        index.copy_(codes)
        torch.index_select(self.table, 0, index.view(-1), out=out.view(-1))


class _RowQuantizer:
    """Quantizes float32 rows of 128 into FP8 codes and power-of-two scales, as ``quantize_rows``, into a row
    buffer's views; optionally writes what the rounding left out. Its scratch holds ``rows`` rows."""

    def __init__(self, fmt: Fp8Format, rows: int, device: torch.device) -> None:
        self.fmt = fmt
        self.scratch = torch.empty(rows, BLOCK_ELEMENTS, dtype=torch.float32, device=device)
        self.largest = torch.empty(rows, dtype=torch.int32, device=device)
        self.decode = _Decoder(fmt, rows, device)

    def __call__(self, values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 left: Optional[torch.Tensor] = None) -> None:
        """``codes`` (r, 128) uint8 and ``scales`` (r,) float32 <- ``values`` (r, 128) float32 quantized; ``left``
        (r, 128) float32, if given, <- values minus what the codes stand for (0 in a non-finite block)."""
        fmt, r = self.fmt, values.shape[0]
        scratch, largest = self.scratch[:r], self.largest[:r]
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
        # values - code * scale, the product rounded first as the kernel does: exact unless it overflows to inf
        # (a block near float32's top), where a fused multiply-add would give a finite residual.
        scratch.mul_(scale[:, None])
        torch.sub(values, scratch, out=left)
        if not all_finite:
            left[~finite] = 0.0


def _aligned(layout: BlockLayout) -> bool:
    """Whether every element sits at its own flat offset in the block grid (every tensor but the last a whole number
    of blocks): then the grid is the bucket itself, followed by zeros, and the passes go block range by block range
    with no scatter or gather."""
    return layout.n_blocks == -(-layout.n_elements // BLOCK_ELEMENTS) and all(
        size % BLOCK_ELEMENTS == 0 for size in layout.sizes[:-1])


def _row_chunks(n_rows: int, n_elements: int) -> List[Tuple[int, int, int, int]]:
    """(first row, end row, first element, end element) of each step over a grid of ``n_rows`` rows whose first
    ``n_elements`` elements are data."""
    out = []
    for r0 in range(0, n_rows, CHUNK_ROWS):
        r1 = min(r0 + CHUNK_ROWS, n_rows)
        out.append((r0, r1, min(r0 * BLOCK_ELEMENTS, n_elements), min(r1 * BLOCK_ELEMENTS, n_elements)))
    return out


def quantize_pass(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float, fmt: Fp8Format,
                  residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """rows <- the blocks of ``src * scale (+ residual)``; residual <- what the rounding left out (float32, or
    bfloat16: widened to add, rounded once to store). On an aligned layout a call allocates nothing and holds a few
    MiB of scratch; otherwise it allocates per call."""
    if not _aligned(layout):
        return lambda: _quantize_scattered(src, layout, rows, scale, fmt, residual)
    device, chunk_rows = src.device, min(CHUNK_ROWS, layout.n_rows)
    codes, scales = _split_rows(rows)
    x = torch.empty(chunk_rows, BLOCK_ELEMENTS, dtype=torch.float32, device=device)
    left = torch.empty_like(x) if residual is not None else None
    quantize = _RowQuantizer(fmt, chunk_rows, device)
    widen = src.dtype != torch.float32
    steps = []
    for r0, r1, e0, e1 in _row_chunks(layout.n_rows, layout.n_elements):
        # No padding in this step and a float32 residual: what is left is written into the residual directly.
        direct = e1 - e0 == (r1 - r0) * BLOCK_ELEMENTS and left is not None and residual.dtype == torch.float32
        steps.append((src[e0:e1], None if residual is None else residual[e0:e1], x[: r1 - r0],
                      x.view(-1)[: e1 - e0], x.view(-1)[e1 - e0:(r1 - r0) * BLOCK_ELEMENTS], codes[r0:r1],
                      scales[r0:r1], None if left is None else (
                          residual[e0:e1].view(-1, BLOCK_ELEMENTS) if direct else left[: r1 - r0]), direct))

    def run() -> None:
        for part, res, grid, flat, padding, part_codes, part_scales, left_rows, direct in steps:
            if widen:  # the kernel widens, then multiplies in float32
                flat.copy_(part)
                if scale != 1.0:
                    flat.mul_(scale)
            elif scale != 1.0:
                torch.mul(part, scale, out=flat)
            else:
                flat.copy_(part)
            if res is not None:
                flat.add_(res)
            padding.zero_()
            quantize(grid, part_codes, part_scales, left_rows)
            if res is not None and not direct:
                res.copy_(left_rows.view(-1)[: res.numel()])  # to a bfloat16 residual: rounded to nearest even

    return run


def _quantize_scattered(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float, fmt: Fp8Format,
                        residual: Optional[torch.Tensor]) -> None:
    """The quantize of a layout whose tensors end inside blocks: scattered into the padded grid, per call."""
    x = src.float()
    if scale != 1.0:
        x = x * scale
    if residual is not None:
        x = x + residual
    positions = layout.positions()
    grid = torch.zeros(layout.n_rows * BLOCK_ELEMENTS, dtype=torch.float32, device=src.device)
    grid.index_copy_(0, positions, x)  # index_copy_/index_select: torch's x[index] is ~300x slower on CPU
    values = grid.view(layout.n_rows, BLOCK_ELEMENTS)
    codes, scales = _split_rows(rows)
    left = torch.empty_like(values) if residual is not None else None
    _RowQuantizer(fmt, layout.n_rows, src.device)(values, codes, scales, left)
    if residual is not None and residual.dtype == torch.float32:
        torch.index_select(left.view(-1), 0, positions, out=residual)
    elif residual is not None:
        residual.copy_(torch.index_select(left.view(-1), 0, positions))


def reduce_pass(received: torch.Tensor, n_ranks: int, out_rows: torch.Tensor, fmt: Fp8Format,
                residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """out_rows <- the requantized sum, in float32 and rank order, of the ranks' copies of this shard's rows (+ the
    residual, float32 or bfloat16); residual <- what the rounding left out, rounded once where bfloat16. A call
    allocates nothing."""
    codes, scales = _split_rows(received)
    per_rank = codes.shape[0] // n_ranks
    out_codes, out_scales = _split_rows(out_rows)
    device, chunk_rows = received.device, max(1, min(CHUNK_ROWS, per_rank))
    total = torch.empty(chunk_rows, BLOCK_ELEMENTS, dtype=torch.float32, device=device)
    decoded = torch.empty_like(total)
    decode = _Decoder(fmt, chunk_rows, device)
    quantize = _RowQuantizer(fmt, chunk_rows, device)
    grid_residual = None if residual is None else residual.view(per_rank, BLOCK_ELEMENTS)
    # A bfloat16 residual: what is left goes to a float32 scratch first, then is rounded once into the residual.
    left = torch.empty_like(total) if residual is not None and residual.dtype != torch.float32 else None
    steps = []
    for r0, r1, _, _ in _row_chunks(per_rank, per_rank * BLOCK_ELEMENTS):
        parts = [(codes[r * per_rank + r0:r * per_rank + r1], scales[r * per_rank + r0:r * per_rank + r1, None])
                 for r in range(n_ranks)]
        steps.append((parts, total[: r1 - r0], decoded[: r1 - r0], out_codes[r0:r1], out_scales[r0:r1],
                      None if grid_residual is None else grid_residual[r0:r1],
                      None if left is None else left[: r1 - r0]))

    def run() -> None:
        for parts, part_total, part_decoded, part_codes, part_scales, part_residual, part_left in steps:
            part_total.zero_()  # the kernel's sum starts at +0.0, so a -0.0 from every rank sums to +0.0
            for rank_codes, rank_scales in parts:
                decode(rank_codes, part_decoded)
                part_decoded.mul_(rank_scales)  # rounded, then added, as the kernel does (whatever the scale)
                part_total.add_(part_decoded)
            if part_residual is not None:
                part_total.add_(part_residual)  # a bfloat16 residual widened exactly, added in float32
            if part_left is None:
                quantize(part_total, part_codes, part_scales, part_residual)
            else:
                quantize(part_total, part_codes, part_scales, part_left)
                part_residual.copy_(part_left)

    return run


def dequantize_pass(rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor, fmt: Fp8Format,
                    stats: Optional[torch.Tensor], canonical_nan: bool = True) -> Callable[[], None]:
    """dst <- the blocks' values, rounded once to dst's dtype (NaNs canonical unless told not to); optional
    [sum of squares, non-finite count]. On an aligned layout a call allocates nothing."""
    codes, scales = _split_rows(rows)
    if not _aligned(layout):
        def scattered() -> None:
            values = torch.empty(layout.n_rows, BLOCK_ELEMENTS, dtype=torch.float32, device=dst.device)
            _Decoder(fmt, layout.n_rows, dst.device)(codes, values)
            values.mul_(scales[:, None])
            _converter(dst, values.view(-1).index_select(0, layout.positions()), 1.0, canonical_nan)()
            finish_stats(stats, dst)

        return scattered
    device, chunk_rows = dst.device, min(CHUNK_ROWS, layout.n_rows)
    decode = _Decoder(fmt, chunk_rows, device)
    values = torch.empty(chunk_rows, BLOCK_ELEMENTS, dtype=torch.float32, device=device)
    steps = [(codes[r0:r1], scales[r0:r1, None], values[: r1 - r0],
              _converter(dst[e0:e1], values.view(-1)[: e1 - e0], 1.0, canonical_nan))
             for r0, r1, e0, e1 in _row_chunks(layout.n_blocks, layout.n_elements)]

    def run() -> None:
        for part_codes, part_scales, part_values, store in steps:
            decode(part_codes, part_values)
            part_values.mul_(part_scales)
            store()
        finish_stats(stats, dst)

    return run


def finish_stats(stats: Optional[torch.Tensor], dst: torch.Tensor) -> None:
    """stats, where given, <- [sum of squares, non-finite count] of ``dst``."""
    if stats is not None:
        stats.zero_()
        _accumulate_stats(stats, dst)


def sum_blocks_pass(received: torch.Tensor, n_ranks: int, layout: BlockLayout, out: torch.Tensor,
                    fmt: Fp8Format) -> Callable[[], None]:
    """out (float32) <- the values of the ``n_ranks`` row slices of ``received`` summed in float32 in rank order
    from the first rank's: the first slice dequantized into ``out``, each further one into a float32 scratch
    buffer and added (the kernel's roundings: each value times its scale, then the adds)."""
    step = layout.n_rows * ROW_BYTES
    slices = [received[r * step:(r + 1) * step] for r in range(n_ranks)]
    first = dequantize_pass(slices[0], layout, out, fmt, None, canonical_nan=False)
    if n_ranks == 1:
        return first
    part = torch.empty_like(out)
    others = [dequantize_pass(rows, layout, part, fmt, None, canonical_nan=False) for rows in slices[1:]]

    def run() -> None:
        first()
        for dequantize in others:
            dequantize()
            out.add_(part)

    return run


def sum_slices_pass(received: torch.Tensor, n_ranks: int, out: torch.Tensor,
                    canonical_nan: bool = True) -> Callable[[], None]:
    """out <- the sum of the ``n_ranks`` equal slices of ``received``, in float32 and rank order from the first
    slice's value, rounded once. A call allocates nothing."""
    size = out.numel()
    total = torch.empty(min(size, CHUNK_ROWS * BLOCK_ELEMENTS), dtype=torch.float32, device=out.device)
    steps = []
    for e0 in range(0, size, total.numel()):
        e1 = min(e0 + total.numel(), size)
        part_total = total[: e1 - e0]
        steps.append((part_total, [received[r * size + e0:r * size + e1] for r in range(n_ranks)],
                      _converter(out[e0:e1], part_total, 1.0, canonical_nan)))

    def run() -> None:
        for part_total, parts, store in steps:
            part_total.copy_(parts[0])  # from the first slice's value, widened exactly, as the kernel
            for part in parts[1:]:
                part_total.add_(part)  # added in float32
            store()

    return run
