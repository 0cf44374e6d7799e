"""Block-scaled FP8 and E2M1 (4-bit) kernels for a sharded exchange, and their typed launchers.

Three passes, one launch each, around an all-to-all and an all-gather (``ddp_triton.runtime.exchange``):

1. ``quantize_blocks``: bucket -> rows. Pre-scale, add the error-feedback residual, find the block's power-of-two
   scale, round to FP8, write codes and scale, and write back the new residual (value - dequantized value).
2. ``reduce_blocks``: the N ranks' copies of this rank's shard of rows -> one shard. Dequantize, sum in float32 in
   rank order, add the shard's own residual, requantize, write back that residual.
3. ``dequantize_blocks``: rows -> bucket, rounded once to the bucket's dtype, optionally with the gradient
   statistics of ``unpack`` (sum of squares, non-finite count).

And one pass for an exchange that ends with the float32 sum (FSDP's reduce-scatter: no second rounding, no
all-gather): ``sum_blocks``, the N ranks' copies of this rank's rows -> their values summed in float32 in rank
order, written where the layout puts each block.

Each is one callable: the plain call, checked in full every time, and ``.prepare(...)``, checked and compiled once
and run on the tensors each call passes (``prepared.py``), for the exchanges that run it every step.

Error feedback keeps its residual (one per element; the reduce's, 128 per row of the shard) in float32 or in
bfloat16, which halves its memory (training loss within run-to-run variation of float32's). Either is widened to
float32 and added in float32; what is left is computed in float32 and stored as float32, or rounded once to
bfloat16 (nearest, ties to even, as torch's ``.to(torch.bfloat16)``), with the same bits on every path (Triton,
compiled CPU, torch). A non-finite block (through its values or its residual) is sent as NaN and its residual
reset to +0 in either dtype; otherwise a residual is finite, or an infinity where a block's dequantized value
overflowed float32, never a NaN. The residual's dtype is part of what a prepared call fixes.

``fmt`` picks the wire format: ``torch.float8_e4m3fn`` (the default) or ``torch.float8_e5m2``, whose rows are
``fp8.ROW_BYTES`` bytes, 128 codes and a float32 scale (``fp8.py``); or ``fp4.E2M1`` (``kernels.FP4_E2M1``), whose
rows are ``fp4.ROW_BYTES`` bytes, 128 E2M1 codes two to a byte and a power-of-two scale byte per 32 elements
(``fp4.py``, its kernels there). ``row_bytes(fmt)`` gives a row's size. Every pass takes the same arguments in
either format. Products and sums are compiled without
FMA contraction (``enable_fp_fusion=False``): a fused multiply-add rounds once where torch rounds twice, and the
residuals must be the same bits on every path.
"""

# No ``from __future__ import annotations``: Triton 3.0's interpreter needs tl.constexpr annotations as objects.
from typing import Any, Optional

import torch

from . import _triton, cpu_fp4, cpu_fp8, fp4
from .blocks import BlockLayout
from .convert import _convert, _load_fp32, _store_fp32, _write_stats
from .dtypes import BITS_DTYPE, OUT_KIND
from .fp8 import BLOCK_ELEMENTS, FORMATS, ROW_BYTES, ROW_WORDS, Fp8Format, _decode, _quantize_block
from .launch import Grid, KernelCall, run_call
from .pack import uses_triton
from .prepared import PreparedCall, with_prepare
from .validation import check_count, check_scale, check_stats, check_vector

triton, tl = _triton.triton, _triton.tl

# One warp per 128-element block: 4 elements a thread, the block's absmax a warp reduction.
_NUM_WARPS = 1

if _triton.AVAILABLE:

    @triton.jit
    def _quantize_blocks_kernel(src, table, residual, rows, words, scale,
                                BLOCK: tl.constexpr, ROW_BYTES_: tl.constexpr, ROW_WORDS_: tl.constexpr,
                                APPLY_SCALE: tl.constexpr, SRC_BF16: tl.constexpr, RESIDUAL: tl.constexpr,
                                RESIDUAL_BF16: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
                                MAX_EXPONENT_OF: tl.constexpr):
        """Program i quantizes row i of the table: (start, length) of one tensor's block in the bucket."""
        row = tl.program_id(0).to(tl.int64)
        start = tl.load(table + row * 2)
        length = tl.load(table + row * 2 + 1).to(tl.int32)
        lanes = tl.arange(0, BLOCK)
        mask = lanes < length
        values = _load_fp32(src + start + lanes, mask, SRC_BF16, True)
        if APPLY_SCALE:
            values = values * scale
        if RESIDUAL:
            values = values + _load_fp32(residual + start + lanes, mask, RESIDUAL_BF16, True)
        values = tl.where(mask, values, 0.0)
        codes, block_scale, dequantized, finite = _quantize_block(values, MANTISSA, BIAS, MAX_EXPONENT_OF)
        tl.store(rows + row * ROW_BYTES_ + lanes, codes.to(tl.uint8))
        tl.store(words + row * ROW_WORDS_ + (ROW_WORDS_ - 1), block_scale.to(tl.int32, bitcast=True))
        if RESIDUAL:
            _store_fp32(residual + start + lanes, tl.where(finite, values - dequantized, 0.0), mask, RESIDUAL_BF16)

    @triton.jit
    def _reduce_blocks_kernel(received, received_words, residual, out, out_words, n_ranks, rank_bytes, rank_words,
                              BLOCK: tl.constexpr, ROW_BYTES_: tl.constexpr, ROW_WORDS_: tl.constexpr,
                              RESIDUAL: tl.constexpr, RESIDUAL_BF16: tl.constexpr, MANTISSA: tl.constexpr,
                              BIAS: tl.constexpr, MAX_EXPONENT_OF: tl.constexpr):
        """Program i sums row i of every rank's slice of ``received`` in float32, in rank order, and requantizes."""
        row = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        code_ptrs = received + row * ROW_BYTES_ + lanes
        scale_ptr = received_words + row * ROW_WORDS_ + (ROW_WORDS_ - 1)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in range(0, n_ranks):
            codes = tl.load(code_ptrs).to(tl.int32)
            block_scale = tl.load(scale_ptr).to(tl.float32, bitcast=True)
            total = total + _decode(codes, MANTISSA, BIAS) * block_scale
            code_ptrs += rank_bytes  # the same row in the next rank's slice
            scale_ptr += rank_words
        values = total
        if RESIDUAL:
            values = values + _load_fp32(residual + row * BLOCK + lanes, None, RESIDUAL_BF16, False)
        codes, block_scale, dequantized, finite = _quantize_block(values, MANTISSA, BIAS, MAX_EXPONENT_OF)
        tl.store(out + row * ROW_BYTES_ + lanes, codes.to(tl.uint8))
        tl.store(out_words + row * ROW_WORDS_ + (ROW_WORDS_ - 1), block_scale.to(tl.int32, bitcast=True))
        if RESIDUAL:
            _store_fp32(residual + row * BLOCK + lanes, tl.where(finite, values - dequantized, 0.0), None,
                        RESIDUAL_BF16)

    @triton.jit
    def _dequantize_blocks_kernel(rows, words, table, dst, partials,
                                  BLOCK: tl.constexpr, ROW_BYTES_: tl.constexpr, ROW_WORDS_: tl.constexpr,
                                  OUT_KIND: tl.constexpr, STATS: tl.constexpr, HW_CONVERT: tl.constexpr,
                                  MANTISSA: tl.constexpr, BIAS: tl.constexpr):
        """Program i writes row i back to its place in the bucket, rounded once to the bucket's dtype."""
        row = tl.program_id(0).to(tl.int64)
        start = tl.load(table + row * 2)
        length = tl.load(table + row * 2 + 1).to(tl.int32)
        lanes = tl.arange(0, BLOCK)
        mask = lanes < length
        codes = tl.load(rows + row * ROW_BYTES_ + lanes).to(tl.int32)
        block_scale = tl.load(words + row * ROW_WORDS_ + (ROW_WORDS_ - 1)).to(tl.float32, bitcast=True)
        bits, stored = _convert(_decode(codes, MANTISSA, BIAS) * block_scale, 1.0, False, OUT_KIND, HW_CONVERT)
        tl.store(dst + start + lanes, bits, mask=mask)
        if STATS:
            _write_stats(partials, row, tl.where(mask, stored, 0.0))

    @triton.jit
    def _sum_blocks_kernel(received, received_words, table, dst, n_ranks, rank_bytes, rank_words,
                           BLOCK: tl.constexpr, ROW_BYTES_: tl.constexpr, ROW_WORDS_: tl.constexpr,
                           MANTISSA: tl.constexpr, BIAS: tl.constexpr):
        """Program i adds row i of every rank's slice of ``received`` in float32, in rank order from the first
        rank's value, and stores the sum where the table puts row i."""
        row = tl.program_id(0).to(tl.int64)
        start = tl.load(table + row * 2)
        length = tl.load(table + row * 2 + 1).to(tl.int32)
        lanes = tl.arange(0, BLOCK)
        mask = lanes < length
        code_ptrs = received + row * ROW_BYTES_ + lanes
        scale_ptr = received_words + row * ROW_WORDS_ + (ROW_WORDS_ - 1)
        block_scale = tl.load(scale_ptr).to(tl.float32, bitcast=True)
        total = _decode(tl.load(code_ptrs).to(tl.int32), MANTISSA, BIAS) * block_scale
        for _ in range(1, n_ranks):
            code_ptrs += rank_bytes  # the same row in the next rank's slice
            scale_ptr += rank_words
            block_scale = tl.load(scale_ptr).to(tl.float32, bitcast=True)
            total = total + _decode(tl.load(code_ptrs).to(tl.int32), MANTISSA, BIAS) * block_scale
        tl.store(dst + start + lanes, total, mask=mask)

else:  # pragma: no cover - exercised only where Triton is missing
    _quantize_blocks_kernel = _reduce_blocks_kernel = _dequantize_blocks_kernel = _sum_blocks_kernel = None


_NO_FUSION = (("enable_fp_fusion", False),)


#: What ``_format`` gives for block-scaled E2M1 (its constants are ``fp4``'s).
_FP4 = "fp4"


def _format(fmt: Any) -> Any:
    """The Fp8Format of an FP8 ``fmt``, or ``_FP4``."""
    if isinstance(fmt, torch.dtype) and fmt in FORMATS:
        return FORMATS[fmt]
    if fmt == fp4.E2M1:
        return _FP4
    raise ValueError(f"the wire format (fmt) must be an fp8 format, torch.float8_e4m3fn or torch.float8_e5m2, or "
                     f"block-scaled E2M1, kernels.FP4_E2M1 ({fp4.E2M1}); got {fmt!r}")


def row_bytes(fmt: Any = torch.float8_e4m3fn) -> int:
    """Bytes of one 128-element block's row in the wire format ``fmt``: 132 for FP8, 68 for E2M1."""
    return fp4.ROW_BYTES if _format(fmt) is _FP4 else ROW_BYTES


def _check_layout(layout: BlockLayout) -> None:
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout (kernels.block_layout), got {type(layout).__name__}")


def _check_rows(rows: torch.Tensor, n_rows: int, name: str, device: torch.device, row_size: int = ROW_BYTES) -> None:
    check_vector(rows, name, numel=n_rows * row_size, dtypes=(torch.uint8,), device=device)
    if rows.storage_offset() % 4:
        raise ValueError(f"{name} must be 4-byte aligned (its rows are read and written as 32-bit words)")


#: The dtypes an error-feedback residual may be stored in (see ``quantize_blocks``).
RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)


def _check_residual(residual: Optional[torch.Tensor], numel: int, device: torch.device) -> None:
    if residual is not None:
        check_vector(residual, "residual", numel=numel, dtypes=RESIDUAL_DTYPES, device=device)


def _residual_arguments(residual: Optional[torch.Tensor], fallback: torch.Tensor) -> tuple:
    """(the kernel's residual argument, RESIDUAL, RESIDUAL_BF16): a bfloat16 residual goes as its int16 bits;
    without one, ``fallback`` stands in (never read)."""
    if residual is None:
        return fallback, False, False
    if residual.dtype == torch.bfloat16:
        return residual.view(torch.int16), True, True
    return residual, True, False


# ---- each pass as a KernelCall for its tensors: run once (a plain call) or kept to repeat (a prepared call) -----


def _quantize_call(src, layout, rows, scale, fmt, residual, checked=True) -> KernelCall:
    spec = _format(fmt)
    if checked:
        _check_layout(layout)
        check_vector(src, "src", numel=layout.n_elements)
        _check_rows(rows, layout.n_rows, "rows", src.device, row_bytes(fmt))
        _check_residual(residual, src.numel(), src.device)
        scale = check_scale(scale)
    if not uses_triton(src.device):
        if spec is _FP4:
            return KernelCall(torch_path=cpu_fp4.quantize_pass(src, layout, rows, scale, residual))
        return KernelCall(torch_path=cpu_fp8.quantize_pass(src, layout, rows, scale, spec, residual))
    src_bf16 = src.dtype == torch.bfloat16
    residual_arg, has_residual, residual_bf16 = _residual_arguments(residual, rows)
    if spec is _FP4:
        args = (src.view(torch.int16) if src_bf16 else src, layout.table_on(src.device), residual_arg,
                rows.view(torch.int32), scale)
        constexprs = dict(BLOCK=BLOCK_ELEMENTS, GROUP=fp4.GROUP_ELEMENTS, ROW_WORDS_=fp4.ROW_WORDS,
                          APPLY_SCALE=scale != 1.0, SRC_BF16=src_bf16, RESIDUAL=has_residual,
                          RESIDUAL_BF16=residual_bf16)
        return KernelCall(launch=(Grid(layout.n_rows, _NUM_WARPS, _NO_FUSION), fp4._quantize_blocks_kernel, args,
                                  constexprs))
    args = (src.view(torch.int16) if src_bf16 else src, layout.table_on(src.device), residual_arg, rows,
            rows.view(torch.int32), scale)
    constexprs = dict(BLOCK=BLOCK_ELEMENTS, ROW_BYTES_=ROW_BYTES, ROW_WORDS_=ROW_WORDS, APPLY_SCALE=scale != 1.0,
                      SRC_BF16=src_bf16, RESIDUAL=has_residual, RESIDUAL_BF16=residual_bf16,
                      MANTISSA=spec.mantissa_bits, BIAS=spec.bias, MAX_EXPONENT_OF=spec.max_exponent)
    grid = Grid(layout.n_rows, _NUM_WARPS, _NO_FUSION)
    return KernelCall(launch=(grid, _quantize_blocks_kernel, args, constexprs))


def _reduce_call(received, n_ranks, out, fmt, residual, checked=True) -> KernelCall:
    spec = _format(fmt)
    if checked:
        check_count(n_ranks, "n_ranks")
        check_vector(out, "out", dtypes=(torch.uint8,))
        if out.numel() % row_bytes(fmt):
            raise ValueError(f"out has {out.numel()} bytes, not whole {row_bytes(fmt)}-byte rows")
    rows_per_rank = out.numel() // row_bytes(fmt)
    if checked:
        _check_rows(out, rows_per_rank, "out", out.device, row_bytes(fmt))
        _check_rows(received, n_ranks * rows_per_rank, "received", out.device, row_bytes(fmt))
        _check_residual(residual, rows_per_rank * BLOCK_ELEMENTS, out.device)
    if not uses_triton(out.device):
        if spec is _FP4:
            return KernelCall(torch_path=cpu_fp4.reduce_pass(received, n_ranks, out, residual))
        return KernelCall(torch_path=cpu_fp8.reduce_pass(received, n_ranks, out, spec, residual))
    residual_arg, has_residual, residual_bf16 = _residual_arguments(residual, out)
    if spec is _FP4:
        args = (received.view(torch.int32), residual_arg, out.view(torch.int32), n_ranks,
                rows_per_rank * fp4.ROW_WORDS)
        constexprs = dict(BLOCK=BLOCK_ELEMENTS, GROUP=fp4.GROUP_ELEMENTS, ROW_WORDS_=fp4.ROW_WORDS,
                          RESIDUAL=has_residual, RESIDUAL_BF16=residual_bf16)
        return KernelCall(launch=(Grid(rows_per_rank, _NUM_WARPS, _NO_FUSION), fp4._reduce_blocks_kernel, args,
                                  constexprs))
    args = (received, received.view(torch.int32), residual_arg, out, out.view(torch.int32), n_ranks,
            rows_per_rank * ROW_BYTES, rows_per_rank * ROW_WORDS)
    constexprs = dict(BLOCK=BLOCK_ELEMENTS, ROW_BYTES_=ROW_BYTES, ROW_WORDS_=ROW_WORDS, RESIDUAL=has_residual,
                      RESIDUAL_BF16=residual_bf16, MANTISSA=spec.mantissa_bits, BIAS=spec.bias,
                      MAX_EXPONENT_OF=spec.max_exponent)
    grid = Grid(rows_per_rank, _NUM_WARPS, _NO_FUSION)
    return KernelCall(launch=(grid, _reduce_blocks_kernel, args, constexprs))


def _dequantize_call(rows, layout, dst, fmt, stats, canonical_nan=True, checked=True) -> KernelCall:
    spec = _format(fmt)
    if checked:
        _check_layout(layout)
        check_vector(dst, "dst", numel=layout.n_elements)
        _check_rows(rows, layout.n_rows, "rows", dst.device, row_bytes(fmt))
        check_stats(stats, dst.device)
    if not uses_triton(dst.device):
        if spec is _FP4:
            return KernelCall(torch_path=cpu_fp4.dequantize_pass(rows, layout, dst, stats, canonical_nan))
        return KernelCall(torch_path=cpu_fp8.dequantize_pass(rows, layout, dst, spec, stats, canonical_nan))
    # With stats, each block's partial sums go to a buffer of this call's own, summed behind the kernel.
    partials = torch.empty((layout.n_blocks, 2), dtype=torch.float32, device=dst.device) if stats is not None \
        else rows
    after = (lambda: torch.sum(partials, dim=0, out=stats)) if stats is not None else None
    grid = Grid(layout.n_blocks, _NUM_WARPS, _NO_FUSION)
    if spec is _FP4:
        args = (rows.view(torch.int32), layout.table_on(dst.device), dst.view(BITS_DTYPE[dst.dtype]), partials)
        constexprs = dict(BLOCK=BLOCK_ELEMENTS, GROUP=fp4.GROUP_ELEMENTS, ROW_WORDS_=fp4.ROW_WORDS,
                          OUT_KIND=OUT_KIND[dst.dtype], STATS=stats is not None, HW_CONVERT=not _triton.INTERPRETER)
        return KernelCall(launch=(grid, fp4._dequantize_blocks_kernel, args, constexprs), after=after)
    args = (rows, rows.view(torch.int32), layout.table_on(dst.device), dst.view(BITS_DTYPE[dst.dtype]), partials)
    constexprs = dict(BLOCK=BLOCK_ELEMENTS, ROW_BYTES_=ROW_BYTES, ROW_WORDS_=ROW_WORDS, OUT_KIND=OUT_KIND[dst.dtype],
                      STATS=stats is not None, HW_CONVERT=not _triton.INTERPRETER, MANTISSA=spec.mantissa_bits,
                      BIAS=spec.bias)
    return KernelCall(launch=(grid, _dequantize_blocks_kernel, args, constexprs), after=after)


def _sum_blocks_call(received, n_ranks, layout, out, fmt, checked=True) -> KernelCall:
    spec = _format(fmt)
    if checked:
        _check_layout(layout)
        check_count(n_ranks, "n_ranks")
        check_vector(out, "out", numel=layout.n_elements, dtypes=(torch.float32,))
        _check_rows(received, n_ranks * layout.n_rows, "received", out.device, row_bytes(fmt))
    if spec is _FP4:
        if not uses_triton(out.device):
            return KernelCall(torch_path=cpu_fp4.sum_blocks_pass(received, n_ranks, layout, out))
        args = (received.view(torch.int32), layout.table_on(out.device), out, n_ranks, layout.n_rows * fp4.ROW_WORDS)
        constexprs = dict(BLOCK=BLOCK_ELEMENTS, GROUP=fp4.GROUP_ELEMENTS, ROW_WORDS_=fp4.ROW_WORDS)
        return KernelCall(launch=(Grid(layout.n_blocks, _NUM_WARPS, _NO_FUSION), fp4._sum_blocks_kernel, args,
                                  constexprs))
    if not uses_triton(out.device):
        return KernelCall(torch_path=cpu_fp8.sum_blocks_pass(received, n_ranks, layout, out, spec))
    args = (received, received.view(torch.int32), layout.table_on(out.device), out, n_ranks,
            layout.n_rows * ROW_BYTES, layout.n_rows * ROW_WORDS)
    constexprs = dict(BLOCK=BLOCK_ELEMENTS, ROW_BYTES_=ROW_BYTES, ROW_WORDS_=ROW_WORDS, MANTISSA=spec.mantissa_bits,
                      BIAS=spec.bias)
    grid = Grid(layout.n_blocks, _NUM_WARPS, _NO_FUSION)
    return KernelCall(launch=(grid, _sum_blocks_kernel, args, constexprs))


# ---- the operations: a plain call, and .prepare(...) for calls that repeat ----------------------------------------


def _prepare_quantize_blocks(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float = 1.0, *,
                             fmt: Any = torch.float8_e4m3fn,
                             residual: Optional[torch.Tensor] = None) -> PreparedCall:
    """:func:`quantize_blocks` checked once for tensors like these; the returned call runs it on the tensors each
    call passes, ``call(src, rows, residual)`` (:class:`~.prepared.PreparedCall`; residual None where the example
    was None)."""
    scale = check_scale(scale)
    return PreparedCall(lambda s, r, res, checked: _quantize_call(s, layout, r, scale, fmt, res, checked),
                        ("src", "rows", "residual"), (src, rows, residual))


@with_prepare(_prepare_quantize_blocks)
def quantize_blocks(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float = 1.0, *,
                    fmt: Any = torch.float8_e4m3fn, residual: Optional[torch.Tensor] = None) -> None:
    """Write the FP8 rows of ``src * scale`` (plus ``residual`` when given, which then receives what was lost).

    ``src`` is a flat bucket (float32, bfloat16 or float16) laid out as ``layout`` says; ``rows`` a uint8 tensor of
    ``layout.n_rows * row_bytes(fmt)`` bytes; ``residual`` float32 or bfloat16 (``RESIDUAL_DTYPES``) of src's
    length, updated in place: widened to add, what is left rounded once to its dtype (the module's docstring).
    """
    run_call(_quantize_call(src, layout, rows, scale, fmt, residual))


def _prepare_reduce_blocks(received: torch.Tensor, n_ranks: int, out: torch.Tensor, *,
                           fmt: Any = torch.float8_e4m3fn,
                           residual: Optional[torch.Tensor] = None) -> PreparedCall:
    """:func:`reduce_blocks` prepared as ``quantize_blocks.prepare`` is: ``call(received, out, residual)``."""
    return PreparedCall(lambda rec, o, res, checked: _reduce_call(rec, n_ranks, o, fmt, res, checked),
                        ("received", "out", "residual"), (received, out, residual))


@with_prepare(_prepare_reduce_blocks)
def reduce_blocks(received: torch.Tensor, n_ranks: int, out: torch.Tensor, *,
                  fmt: Any = torch.float8_e4m3fn, residual: Optional[torch.Tensor] = None) -> None:
    """``out`` <- the requantized float32 sum of the ``n_ranks`` row slices of ``received`` (one per rank, each as
    many rows as ``out``), plus ``residual`` (float32 or bfloat16, 128 per row) when given, which then receives what
    was lost, rounded once to its dtype."""
    run_call(_reduce_call(received, n_ranks, out, fmt, residual))


def _prepare_dequantize_blocks(rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor, *,
                               fmt: Any = torch.float8_e4m3fn, stats: Optional[torch.Tensor] = None,
                               canonical_nan: bool = True) -> PreparedCall:
    """:func:`dequantize_blocks` prepared as ``quantize_blocks.prepare`` is: ``call(rows, dst, stats)``;
    ``canonical_nan`` as for ``kernels.pack.prepare``."""
    return PreparedCall(lambda r, d, st, checked: _dequantize_call(r, layout, d, fmt, st, canonical_nan, checked),
                        ("rows", "dst", "stats"), (rows, dst, stats))


@with_prepare(_prepare_dequantize_blocks)
def dequantize_blocks(rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor, *,
                      fmt: Any = torch.float8_e4m3fn, stats: Optional[torch.Tensor] = None) -> None:
    """``dst`` (the flat bucket, float32/bfloat16/float16) <- the rows' values, rounded once; with ``stats`` (float32
    (2,)) also the sum of squares and the non-finite count of what was stored, as :func:`kernels.unpack` gives."""
    run_call(_dequantize_call(rows, layout, dst, fmt, stats))


def _prepare_sum_blocks(received: torch.Tensor, n_ranks: int, layout: BlockLayout, out: torch.Tensor, *,
                        fmt: Any = torch.float8_e4m3fn) -> PreparedCall:
    """:func:`sum_blocks` prepared as ``quantize_blocks.prepare`` is: ``call(received, out)``."""
    return PreparedCall(lambda rec, o, checked: _sum_blocks_call(rec, n_ranks, layout, o, fmt, checked),
                        ("received", "out"), (received, out))


@with_prepare(_prepare_sum_blocks)
def sum_blocks(received: torch.Tensor, n_ranks: int, layout: BlockLayout, out: torch.Tensor, *,
               fmt: Any = torch.float8_e4m3fn) -> None:
    """``out`` (float32, ``layout.n_elements``) <- the values of the ``n_ranks`` row slices of ``received`` (each
    ``layout.n_rows`` rows, one per rank, 4-byte aligned; not overlapping ``out``), summed in float32 in rank order
    from the first rank's, each block written where ``layout`` puts it: a reduce-scatter's sum kept in float32, in
    one pass over the received rows. A NaN is a NaN: its sign and payload bits are the arithmetic's, as an
    all-reduce's are."""
    run_call(_sum_blocks_call(received, n_ranks, layout, out, fmt))
