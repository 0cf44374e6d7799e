"""The plain-torch path of the wire-format kernels (block-scaled FP8, summing slices in float32), same bits.

CPU tensors take this path unless ``TRITON_INTERPRET=1`` (the interpreter is far too slow for training); the tests
check that both give identical bits. Every float32 operation here is the one the kernel does, in the same order:
scale, add the residual, choose the block's power-of-two scale, round, and sum the ranks' blocks in rank order.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, List, Optional, Tuple

import torch

from . import native_cpu
from .blocks import BlockLayout
from .fp8 import BLOCK_ELEMENTS, E4M3, E5M2, MAX_EXPONENT, MIN_EXPONENT, NAN_CODE, ROW_BYTES, ROW_WORDS, Fp8Format
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

#: Blocks per step of the bound forms: float32 buffers of 1 MiB, which stay in a core's L2 cache between the passes
#: over them, and bound what a bound launch holds (a few MiB, whatever the bucket's size).
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


def bind_quantize_blocks(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float, fmt: Fp8Format,
                         residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """rows <- the blocks of ``src * scale (+ residual)``; residual <- what the rounding left out. Bound: on an
    aligned layout a call allocates nothing and holds a few MiB of scratch; otherwise it allocates per call."""
    passes = _native(fmt)
    if passes is not None:
        return _native_quantize(passes, src, layout, rows, scale, residual)
    return _torch_quantize(src, layout, rows, scale, fmt, residual)


def _torch_quantize(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float, fmt: Fp8Format,
                    residual: Optional[torch.Tensor]) -> Callable[[], None]:
    if not _aligned(layout):
        return lambda: quantize_blocks_scattered(src, layout, rows, scale, fmt, residual)
    device, chunk_rows = src.device, min(CHUNK_ROWS, layout.n_rows)
    codes, scales = _split_rows(rows)
    x = torch.empty(chunk_rows, BLOCK_ELEMENTS, dtype=torch.float32, device=device)
    left = torch.empty_like(x) if residual is not None else None
    quantize = _RowQuantizer(fmt, chunk_rows, device)
    widen = src.dtype != torch.float32
    steps = []
    for r0, r1, e0, e1 in _row_chunks(layout.n_rows, layout.n_elements):
        whole = e1 - e0 == (r1 - r0) * BLOCK_ELEMENTS  # no padding in this step: the residual is written directly
        steps.append((src[e0:e1], None if residual is None else residual[e0:e1], x[: r1 - r0],
                      x.view(-1)[: e1 - e0], x.view(-1)[e1 - e0:(r1 - r0) * BLOCK_ELEMENTS], codes[r0:r1],
                      scales[r0:r1], None if left is None else (
                          residual[e0:e1].view(-1, BLOCK_ELEMENTS) if whole else left[: r1 - r0]), whole))

    def run() -> None:
        for part, res, grid, flat, padding, part_codes, part_scales, left_rows, whole in steps:
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
            if res is not None and not whole:
                res.copy_(left_rows.view(-1)[: res.numel()])

    return run


def quantize_blocks_scattered(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float,
                              fmt: Fp8Format, residual: Optional[torch.Tensor]) -> None:
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
    if residual is not None:
        torch.index_select(left.view(-1), 0, positions, out=residual)


def bind_reduce_blocks(received: torch.Tensor, n_ranks: int, out_rows: torch.Tensor, fmt: Fp8Format,
                       residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """out_rows <- the requantized sum, in float32 and rank order, of the ranks' copies of this shard's rows (+ the
    residual); residual <- what the rounding left out. Bound: a call allocates nothing."""
    passes = _native(fmt)
    if passes is not None:
        return _native_reduce(passes, received, n_ranks, out_rows, residual)
    return _torch_reduce(received, n_ranks, out_rows, fmt, residual)


def _torch_reduce(received: torch.Tensor, n_ranks: int, out_rows: torch.Tensor, fmt: Fp8Format,
                  residual: Optional[torch.Tensor]) -> Callable[[], None]:
    codes, scales = _split_rows(received)
    per_rank = codes.shape[0] // n_ranks
    out_codes, out_scales = _split_rows(out_rows)
    device, chunk_rows = received.device, max(1, min(CHUNK_ROWS, per_rank))
    total = torch.empty(chunk_rows, BLOCK_ELEMENTS, dtype=torch.float32, device=device)
    decoded = torch.empty_like(total)
    decode = _Decoder(fmt, chunk_rows, device)
    quantize = _RowQuantizer(fmt, chunk_rows, device)
    grid_residual = None if residual is None else residual.view(per_rank, BLOCK_ELEMENTS)
    steps = []
    for r0, r1, _, _ in _row_chunks(per_rank, per_rank * BLOCK_ELEMENTS):
        parts = [(codes[r * per_rank + r0:r * per_rank + r1], scales[r * per_rank + r0:r * per_rank + r1, None])
                 for r in range(n_ranks)]
        steps.append((parts, total[: r1 - r0], decoded[: r1 - r0], out_codes[r0:r1], out_scales[r0:r1],
                      None if grid_residual is None else grid_residual[r0:r1]))

    def run() -> None:
        for parts, part_total, part_decoded, part_codes, part_scales, part_residual in steps:
            part_total.zero_()  # the kernel's sum starts at +0.0, so a -0.0 from every rank sums to +0.0
            for rank_codes, rank_scales in parts:
                decode(rank_codes, part_decoded)
                part_decoded.mul_(rank_scales)  # rounded, then added, as the kernel does (whatever the scale)
                part_total.add_(part_decoded)
            if part_residual is not None:
                part_total.add_(part_residual)
            quantize(part_total, part_codes, part_scales, part_residual)

    return run


def bind_dequantize_blocks(rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor, fmt: Fp8Format,
                           stats: Optional[torch.Tensor], canonical_nan: bool = True) -> Callable[[], None]:
    """dst <- the blocks' values, rounded once to dst's dtype (NaNs canonical unless told not to); optional
    [sum of squares, non-finite count]. Bound: on an aligned layout a call allocates nothing."""
    passes = _native(fmt)
    if passes is not None:
        return _native_dequantize(passes, rows, layout, dst, stats, canonical_nan)
    return _torch_dequantize(rows, layout, dst, fmt, stats, canonical_nan)


def _torch_dequantize(rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor, fmt: Fp8Format,
                      stats: Optional[torch.Tensor], canonical_nan: bool = True) -> Callable[[], None]:
    codes, scales = _split_rows(rows)
    if not _aligned(layout):
        def scattered() -> None:
            values = torch.empty(layout.n_rows, BLOCK_ELEMENTS, dtype=torch.float32, device=dst.device)
            _Decoder(fmt, layout.n_rows, dst.device)(codes, values)
            values.mul_(scales[:, None])
            _converter(dst, values.view(-1).index_select(0, layout.positions()), 1.0, canonical_nan)()
            _finish_stats(stats, dst)

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
        _finish_stats(stats, dst)

    return run


def _finish_stats(stats: Optional[torch.Tensor], dst: torch.Tensor) -> None:
    if stats is not None:
        stats.zero_()
        _accumulate_stats(stats, dst)


def bind_sum_slices(received: torch.Tensor, n_ranks: int, out: torch.Tensor,
                    canonical_nan: bool = True) -> Callable[[], None]:
    """out <- the sum of the ``n_ranks`` equal slices of ``received``, in float32 and rank order from the first
    slice's value, rounded once. Bound: a call allocates nothing."""
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


# ---- the compiled passes (native_cpu): one sweep per pass, checked against the torch passes on first use --------


def cpu_fp8_passes(fmt: Fp8Format = E4M3) -> str:
    """Which FP8 passes a bind on CPU tensors takes now: "compiled" (``fp8_cpu.c``) or "torch"."""
    return "compiled" if _native(fmt) is not None else "torch"


def _native(fmt: Fp8Format) -> Optional[native_cpu.Fp8Passes]:
    """The compiled passes of ``fmt`` where they are enabled, built and give the torch passes' bits; else None."""
    if not native_cpu.enabled():
        return None
    return _checked_native(fmt.dtype)


@functools.lru_cache(maxsize=None)
def _checked_native(dtype: torch.dtype) -> Optional[native_cpu.Fp8Passes]:
    library = native_cpu.library()
    if library is None:
        return None
    fmt = E4M3 if dtype == torch.float8_e4m3fn else E5M2
    passes = library["e4m3" if fmt is E4M3 else "e5m2"]
    problem = _disagreement(passes, fmt)
    if problem is not None:
        warnings.warn(f"ddp_triton: the compiled CPU FP8 passes differ from the torch passes ({problem}) and are "
                      "not used; CPU tensors take the plain-torch FP8 path", RuntimeWarning, stacklevel=3)
        return None
    return passes


def _self_check_values(n: int, seed: int) -> torch.Tensor:
    """Values over float32's whole range: magnitudes from 2^-149 to 2^120 block by block, exact zeros and -0, and
    from five blocks on, a block of ties at FP8 precision, one holding an infinity, one a NaN and one a value whose
    dequantized code overflows."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen)
    exponents = torch.randint(-149, 120, (-(-n // BLOCK_ELEMENTS),), generator=gen).repeat_interleave(BLOCK_ELEMENTS)
    values = values * torch.pow(2.0, exponents[:n].double()).float()
    values[1:BLOCK_ELEMENTS:7] = 0.0
    values[2:BLOCK_ELEMENTS:11] = -0.0
    ties = torch.arange(BLOCK_ELEMENTS, dtype=torch.float32)
    halfway = torch.where(ties % 2 == 0, (2 * (ties % 8) + 1) / 16.0, (2 * (ties % 4) + 1) / 8.0)  # E4M3's, E5M2's
    if n >= 5 * BLOCK_ELEMENTS:
        values[BLOCK_ELEMENTS:2 * BLOCK_ELEMENTS] = (1.0 + halfway) * torch.where(ties % 3 == 0, -1.0, 1.0)
        values[3 * BLOCK_ELEMENTS + 5] = float("inf")
        values[4 * BLOCK_ELEMENTS + 9] = float("nan")
    if n >= 6 * BLOCK_ELEMENTS:
        values[5 * BLOCK_ELEMENTS + 3] = 3.3e38  # its block's largest code times the scale overflows to inf
    return values


def _disagreement(passes: native_cpu.Fp8Passes, fmt: Fp8Format) -> Optional[str]:
    """Where the compiled passes' bits differ from the torch passes' on values over float32's range (quantize with
    error feedback and at scale 1 without, a reduce over three ranks, dequantize to float32 and bfloat16 with
    canonical NaNs), or None."""
    from .blocks import block_layout

    n, ranks = 17 * BLOCK_ELEMENTS + 77, 3  # a shard of 6 blocks or more: room for every kind of block
    layout = block_layout([77, 5 * BLOCK_ELEMENTS + 3, n - 5 * BLOCK_ELEMENTS - 80], ranks)  # short blocks inside
    src = _self_check_values(n, seed=1)
    results = []
    for native in (True, False):
        residual = _self_check_values(n, seed=2) * 2.0**-10
        rows = torch.zeros(layout.n_rows * ROW_BYTES, dtype=torch.uint8)
        if native:
            _native_quantize(passes, src, layout, rows, 0.5, residual)()
        else:
            _torch_quantize(src, layout, rows, 0.5, fmt, residual)()
        received = torch.cat([rows[: layout.rows_per_shard * ROW_BYTES]] * ranks)
        out = torch.zeros(layout.rows_per_shard * ROW_BYTES, dtype=torch.uint8)
        shard_residual = _self_check_values(layout.rows_per_shard * BLOCK_ELEMENTS, seed=3) * 2.0**-12
        dst, dst16 = torch.empty(n), torch.empty(n, dtype=torch.bfloat16)
        plain = torch.zeros_like(rows)  # the other quantize: scale 1, no residual
        if native:
            _native_reduce(passes, received, ranks, out, shard_residual)()
            _native_dequantize(passes, rows, layout, dst, None, True)()
            _native_dequantize(passes, rows, layout, dst16, None, True)()
            _native_quantize(passes, src, layout, plain, 1.0, None)()
        else:
            _torch_reduce(received, ranks, out, fmt, shard_residual)()
            _torch_dequantize(rows, layout, dst, fmt, None, True)()
            _torch_dequantize(rows, layout, dst16, fmt, None, True)()
            _torch_quantize(src, layout, plain, 1.0, fmt, None)()
        results.append({"quantized rows": rows, "residual": residual.view(torch.int32), "reduced rows": out,
                        "reduce's residual": shard_residual.view(torch.int32), "dequantized": dst.view(torch.int32),
                        "dequantized to bfloat16": dst16.view(torch.int16), "rows at scale 1 without residual": plain})
    for what, got in results[0].items():
        if not torch.equal(got, results[1][what]):
            return f"{fmt.dtype}: the {what}"
    return None


def _keeping(call: Callable[[], None], *tensors: Optional[torch.Tensor]) -> Callable[[], None]:
    """``call``, holding ``tensors``: the C functions get addresses, so the memory behind them must live as long
    as the bound call does (as the torch passes' views keep theirs)."""
    call.keeps = tensors  # type: ignore[attr-defined]
    return call


def _row_spans(layout: BlockLayout) -> Tuple[Tuple[int, int, int, int], ...]:
    """(first row, end row, first element, end element) of each step of CHUNK_ROWS rows of ``layout``: the
    elements its data rows hold (empty for padding)."""
    return layout.step_spans(CHUNK_ROWS)


def _native_quantize(passes: native_cpu.Fp8Passes, src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor,
                     scale: float, residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """The compiled quantize, any layout (its block table says where each row's elements are): one call for a
    float32 bucket; a 16-bit one is widened step by step into a float32 scratch buffer that stays in cache (the
    kernel widens, then multiplies)."""
    apply_scale = int(scale != 1.0)
    residual_at = residual.data_ptr() if residual is not None else None
    table = layout.table
    if src.dtype == torch.float32:
        arguments = (src.data_ptr(), 0, table.data_ptr(), layout.n_rows, scale, apply_scale, residual_at,
                     rows.data_ptr())
        return _keeping(lambda: passes.quantize(*arguments), src, rows, residual, table)
    wide = torch.empty(min(CHUNK_ROWS, layout.n_rows) * BLOCK_ELEMENTS, dtype=torch.float32, device=src.device)
    steps = [(src[e0:e1], wide[: e1 - e0], (wide.data_ptr(), e0, table.data_ptr() + 16 * r0, r1 - r0, scale,
                                            apply_scale, residual_at, rows.data_ptr() + ROW_BYTES * r0))
             for r0, r1, e0, e1 in _row_spans(layout)]

    def run() -> None:
        for part, widened, arguments in steps:
            widened.copy_(part)
            passes.quantize(*arguments)

    return _keeping(run, src, rows, residual, wide, table)


def _native_reduce(passes: native_cpu.Fp8Passes, received: torch.Tensor, n_ranks: int, out_rows: torch.Tensor,
                   residual: Optional[torch.Tensor]) -> Callable[[], None]:
    arguments = (received.data_ptr(), out_rows.numel() // ROW_BYTES, n_ranks,
                 residual.data_ptr() if residual is not None else None, out_rows.data_ptr())
    return _keeping(lambda: passes.reduce(*arguments), received, out_rows, residual)


def _native_dequantize(passes: native_cpu.Fp8Passes, rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor,
                       stats: Optional[torch.Tensor], canonical_nan: bool) -> Callable[[], None]:
    """The compiled dequantize, any layout: straight into a float32 bucket; into a 16-bit one through a float32
    scratch buffer, step by step, rounded once by torch's conversion."""
    table = layout.table
    if dst.dtype == torch.float32:
        arguments = (rows.data_ptr(), table.data_ptr(), layout.n_blocks, dst.data_ptr(), 0, int(canonical_nan))

        def direct() -> None:
            passes.dequantize(*arguments)
            _finish_stats(stats, dst)

        return _keeping(direct, rows, dst, table)
    values = torch.empty(min(CHUNK_ROWS, layout.n_rows) * BLOCK_ELEMENTS, dtype=torch.float32, device=dst.device)
    steps = [((rows.data_ptr() + ROW_BYTES * r0, table.data_ptr() + 16 * r0, min(r1, layout.n_blocks) - r0,
               values.data_ptr(), e0, 0), _converter(dst[e0:e1], values[: e1 - e0], 1.0, canonical_nan))
             for r0, r1, e0, e1 in _row_spans(layout) if e1 > e0]

    def through_scratch() -> None:
        for arguments, store in steps:
            passes.dequantize(*arguments)
            store()
        _finish_stats(stats, dst)

    return _keeping(through_scratch, rows, dst, values, table)


def bind_sum_blocks(received: torch.Tensor, n_ranks: int, layout: BlockLayout, out: torch.Tensor,
                    fmt: Fp8Format) -> Callable[[], None]:
    """out (float32) <- the values of the ``n_ranks`` row slices of ``received`` summed in float32 in rank order
    from the first rank's: the first slice dequantized into ``out``, each further one into a float32 scratch
    buffer and added (the kernel's roundings: each value times its scale, then the adds)."""
    passes = _native(fmt)
    if passes is not None:
        return _native_sum_blocks(passes, received, n_ranks, layout, out)
    step = layout.n_rows * ROW_BYTES
    slices = [received[r * step:(r + 1) * step] for r in range(n_ranks)]
    first = bind_dequantize_blocks(slices[0], layout, out, fmt, None, canonical_nan=False)
    if n_ranks == 1:
        return first
    part = torch.empty_like(out)
    others = [bind_dequantize_blocks(rows, layout, part, fmt, None, canonical_nan=False) for rows in slices[1:]]

    def run() -> None:
        first()
        for dequantize in others:
            dequantize()
            out.add_(part)

    return run


def _native_sum_blocks(passes: native_cpu.Fp8Passes, received: torch.Tensor, n_ranks: int, layout: BlockLayout,
                       out: torch.Tensor) -> Callable[[], None]:
    """The compiled sum of blocks, step by step: each step's rows of the first rank dequantized into ``out``, each
    further rank's into a scratch buffer that stays in cache, and added there (no scratch of ``out``'s size)."""
    table, rank_bytes = layout.table, layout.n_rows * ROW_BYTES
    values = torch.empty(min(CHUNK_ROWS, layout.n_rows) * BLOCK_ELEMENTS, dtype=torch.float32, device=out.device)
    steps = []
    for r0, r1, e0, e1 in _row_spans(layout):
        if e1 == e0:
            continue
        rows = min(r1, layout.n_blocks) - r0
        at = [(received.data_ptr() + rank * rank_bytes + ROW_BYTES * r0, table.data_ptr() + 16 * r0, rows)
              for rank in range(n_ranks)]
        steps.append((at, e0, out[e0:e1], values[: e1 - e0]))

    def run() -> None:
        for at, e0, part_out, part_values in steps:
            passes.dequantize(*at[0], out.data_ptr(), 0, 0)
            for rows_at in at[1:]:
                passes.dequantize(*rows_at, values.data_ptr(), e0, 0)
                part_out.add_(part_values)

    return _keeping(run, received, out, values, table)


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


def sum_slices(received: torch.Tensor, n_ranks: int, out: torch.Tensor) -> None:
    """out <- the sum of the ``n_ranks`` equal slices of ``received``, in float32 and rank order, rounded once."""
    bind_sum_slices(received, n_ranks, out)()


def sum_blocks(received: torch.Tensor, n_ranks: int, layout: BlockLayout, out: torch.Tensor,
               fmt: Fp8Format) -> None:
    """out (float32) <- the ranks' row slices' values summed in float32 in rank order."""
    bind_sum_blocks(received, n_ranks, layout, out, fmt)()
