"""Block-scaled 4-bit floats (E2M1) as a wire format: the row layout, and its Triton functions and kernels.

Half of FP8's bytes between nodes. Blocks are FP8's (``fp8.BLOCK_ELEMENTS`` = 128 elements, each tensor its own
blocks, ``blocks.BlockLayout``); a block travels as one row of ``ROW_BYTES`` bytes: its 128 values as E2M1 codes, two
to a byte (element 2i in the low nibble of byte i), then one scale byte per group of ``GROUP_ELEMENTS`` elements.
``bench/fp4_candidates.py`` chose this among E2M1 and INT4 values, groups of 16 to 128, E8M0, E4M3 and float32 scales,
with and without a Hadamard rotation (``bench/RESULTS.md`` has its table).

E2M1 (the OCP MX and NVFP4 element): a sign bit and the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0-7). A group's
scale is E8M0, a biased power of two (byte ``e + 127``): the smallest 2^e with ``absmax / 2^e <= 6``, e clamped to
[-126, 126] as FP8's, so scaling is exact and every path gives the same bits. A value is rounded to the nearest
magnitude, ties to the even code, by comparing it with the midpoints (exact on every path); the sign bit is kept, so
-0.0 travels as code 8. E2M1 has no NaN: a block with a non-finite value is sent with every scale byte 0xFF (E8M0's
NaN) and codes 0, and decodes to NaN everywhere, so an overflow reaches every rank as FP8's NaN block does; its
residual is reset to 0.

A row is read and written as 32-bit words (its codes 8 to a word, its scales 4 to a word): stores of whole words,
and the same little-endian bytes on every path.
"""

# No ``from __future__ import annotations``: Triton 3.0's interpreter needs tl.constexpr annotations as objects.
import torch

from . import _triton
from .convert import _convert, _load_fp32, _store_fp32, _write_stats
from .fp8 import BLOCK_ELEMENTS

triton, tl = _triton.triton, _triton.tl

#: The format's key where a kernel takes ``fmt``: torch's own dtype of packed E2M1 pairs where this torch has it
#: (2.8 on), else its name.
E2M1 = getattr(torch, "float4_e2m1fn_x2", "float4_e2m1fn_x2")
#: Elements per scale: 32, as MXFP4's; bench/fp4_candidates.py trained it as well as groups of 16 (one byte per 16
#: elements more) and better than 64 or 128 (RESULTS.md, H22).
GROUP_ELEMENTS = 32
GROUPS = BLOCK_ELEMENTS // GROUP_ELEMENTS
#: Bytes of the codes of one block, two to a byte; the scales follow at this 4-byte aligned offset.
CODE_BYTES = BLOCK_ELEMENTS // 2
ROW_BYTES = CODE_BYTES + GROUPS
ROW_WORDS = ROW_BYTES // 4
#: The scale byte of a non-finite block (E8M0's NaN).
NAN_SCALE = 0xFF
#: The magnitudes by code (0-7).
VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

assert BLOCK_ELEMENTS % GROUP_ELEMENTS == 0 and GROUPS % 4 == 0, "a row's scales fill whole 32-bit words"


if _triton.AVAILABLE:

    @triton.jit
    def _group_exponents(values, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """(e per group [BLOCK // GROUP], finite) of a block of float32 ``values``: the smallest power-of-two scale
        exponent that fits each group's largest magnitude under 6, clamped to [-126, 126]; finite: the whole block
        is. Integer arithmetic on the magnitudes' bits, as fp8's ``_block_exponent``: 6 is 1.5 * 2^2, so a magnitude
        whose mantissa is above 1.5's (0x400000) needs one more."""
        magnitude = values.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        largest = tl.max(tl.reshape(magnitude, [BLOCK // GROUP, GROUP]), axis=1)
        finite = tl.max(largest, axis=0) < 0x7F800000
        exponent = (largest >> 23) - 127 - 2 + ((largest & 0x7FFFFF) > 0x400000).to(tl.int32)
        exponent = tl.minimum(tl.maximum(exponent, -126), 126)
        return tl.where(finite, exponent, 0), finite

    @triton.jit
    def _per_element(per_group, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """A value per group [BLOCK // GROUP] repeated over its group's elements: [BLOCK]."""
        return tl.reshape(tl.broadcast_to(per_group[:, None], [BLOCK // GROUP, GROUP]), [BLOCK])

    @triton.jit
    def _encode(values):
        """float32 values with |v| <= 6 -> E2M1 codes (int32, 0-15): nearest, ties to the even code; sign kept."""
        a = tl.abs(values)
        code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
                + (a > 5.0).to(tl.int32))
        return code | ((values.to(tl.int32, bitcast=True) >> 28) & 8)

    @triton.jit
    def _decode(codes):
        """E2M1 codes (int32, 0-15) -> float32, exactly."""
        exponent = (codes >> 1) & 3
        mantissa = codes & 1
        magnitude = tl.where(exponent == 0, mantissa * 0x3F000000, ((exponent + 126) << 23) | (mantissa << 22))
        return (magnitude | ((codes & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _power_of_two(exponent):
        """2^exponent as float32, for exponent in [-126, 126]."""
        return ((exponent + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _quantize_block(values, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """A block of float32 values -> (code words [BLOCK // 8], scale words [BLOCK // GROUP // 4], dequantized
        values [BLOCK], finite)."""
        exponent, finite = _group_exponents(values, BLOCK, GROUP)
        per_element = _per_element(exponent, BLOCK, GROUP)
        codes = _encode(values * _power_of_two(-per_element))
        codes = tl.where(finite, codes, 0)
        dequantized = _decode(codes) * _power_of_two(per_element)
        shifts = tl.arange(0, 8) * 4
        code_words = tl.sum(tl.reshape(codes, [BLOCK // 8, 8]) << shifts[None, :], axis=1)
        scale_bytes = tl.where(finite, exponent + 127, 0xFF)
        scale_words = tl.sum(tl.reshape(scale_bytes, [BLOCK // GROUP // 4, 4]) << (tl.arange(0, 4) * 8)[None, :],
                             axis=1)
        return code_words, scale_words, dequantized, finite

    @triton.jit
    def _dequantize_row(words, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """One row's float32 values [BLOCK] from its 32-bit words (codes, then scales): NaN where the scale is 0xFF."""
        code_words = tl.load(words + tl.arange(0, BLOCK // 8))
        codes = tl.reshape((code_words[:, None] >> (tl.arange(0, 8) * 4)[None, :]) & 15, [BLOCK])
        scale_words = tl.load(words + BLOCK // 8 + tl.arange(0, BLOCK // GROUP // 4))
        scale_bytes = tl.reshape((scale_words[:, None] >> (tl.arange(0, 4) * 8)[None, :]) & 0xFF, [BLOCK // GROUP])
        scale_bytes = _per_element(scale_bytes, BLOCK, GROUP)
        values = (_decode(codes) * (scale_bytes << 23).to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
        return tl.where(scale_bytes == 0xFF, 0x7FC00000, values).to(tl.float32, bitcast=True)

    @triton.jit
    def _store_row(words, code_words, scale_words, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """One row's code words, then its scale words, as whole 32-bit words."""
        tl.store(words + tl.arange(0, BLOCK // 8), code_words)
        if BLOCK // GROUP // 4 == 1:  # one scale word: Triton 3.0's interpreter stores a [1] block as two words
            tl.store(words + BLOCK // 8, tl.sum(scale_words, axis=0))
        else:
            tl.store(words + BLOCK // 8 + tl.arange(0, BLOCK // GROUP // 4), scale_words)

    @triton.jit
    def _quantize_blocks_kernel(src, table, residual, words, scale,
                                BLOCK: tl.constexpr, GROUP: tl.constexpr, ROW_WORDS_: tl.constexpr,
                                APPLY_SCALE: tl.constexpr, SRC_BF16: tl.constexpr, RESIDUAL: tl.constexpr,
                                RESIDUAL_BF16: tl.constexpr):
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
        code_words, scale_words, dequantized, finite = _quantize_block(values, BLOCK, GROUP)
        _store_row(words + row * ROW_WORDS_, code_words, scale_words, BLOCK, GROUP)
        if RESIDUAL:
            _store_fp32(residual + start + lanes, tl.where(finite, values - dequantized, 0.0), mask, RESIDUAL_BF16)

    @triton.jit
    def _reduce_blocks_kernel(received, residual, out, n_ranks, rank_words,
                              BLOCK: tl.constexpr, GROUP: tl.constexpr, ROW_WORDS_: tl.constexpr,
                              RESIDUAL: tl.constexpr, RESIDUAL_BF16: tl.constexpr):
        """Program i sums row i of every rank's slice of ``received`` in float32, in rank order from +0, and
        requantizes."""
        row = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        row_words = received + row * ROW_WORDS_
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in range(0, n_ranks):
            total = total + _dequantize_row(row_words, BLOCK, GROUP)
            row_words += rank_words  # the same row in the next rank's slice
        values = total
        if RESIDUAL:
            values = values + _load_fp32(residual + row * BLOCK + lanes, None, RESIDUAL_BF16, False)
        code_words, scale_words, dequantized, finite = _quantize_block(values, BLOCK, GROUP)
        _store_row(out + row * ROW_WORDS_, code_words, scale_words, BLOCK, GROUP)
        if RESIDUAL:
            _store_fp32(residual + row * BLOCK + lanes, tl.where(finite, values - dequantized, 0.0), None,
                        RESIDUAL_BF16)

    @triton.jit
    def _dequantize_blocks_kernel(words, table, dst, partials,
                                  BLOCK: tl.constexpr, GROUP: tl.constexpr, ROW_WORDS_: tl.constexpr,
                                  OUT_KIND: tl.constexpr, STATS: tl.constexpr, HW_CONVERT: tl.constexpr):
        """Program i writes row i back to its place in the bucket, rounded once to the bucket's dtype."""
        row = tl.program_id(0).to(tl.int64)
        start = tl.load(table + row * 2)
        length = tl.load(table + row * 2 + 1).to(tl.int32)
        lanes = tl.arange(0, BLOCK)
        mask = lanes < length
        values = _dequantize_row(words + row * ROW_WORDS_, BLOCK, GROUP)
        bits, stored = _convert(values, 1.0, False, OUT_KIND, HW_CONVERT)
        tl.store(dst + start + lanes, bits, mask=mask)
        if STATS:
            _write_stats(partials, row, tl.where(mask, stored, 0.0))

    @triton.jit
    def _sum_blocks_kernel(received, table, dst, n_ranks, rank_words,
                           BLOCK: tl.constexpr, GROUP: tl.constexpr, ROW_WORDS_: tl.constexpr):
        """Program i adds row i of every rank's slice of ``received`` in float32, in rank order from the first
        rank's value, and stores the sum where the table puts row i."""
        row = tl.program_id(0).to(tl.int64)
        start = tl.load(table + row * 2)
        length = tl.load(table + row * 2 + 1).to(tl.int32)
        lanes = tl.arange(0, BLOCK)
        mask = lanes < length
        row_words = received + row * ROW_WORDS_
        total = _dequantize_row(row_words, BLOCK, GROUP)
        for _ in range(1, n_ranks):
            row_words += rank_words
            total = total + _dequantize_row(row_words, BLOCK, GROUP)
        tl.store(dst + start + lanes, total, mask=mask)

else:  # pragma: no cover - exercised only where Triton is missing
    _quantize_blocks_kernel = _reduce_blocks_kernel = _dequantize_blocks_kernel = _sum_blocks_kernel = None

