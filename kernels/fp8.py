"""Block-scaled FP8 as the wire format: the row layout, and the Triton functions that encode and decode it.

A gradient is cut into blocks of ``BLOCK_ELEMENTS`` elements, each gradient into its own blocks (its last one short),
so a small-valued tensor (a LayerNorm bias) never shares a scale with a large one. A block travels as one row of
``ROW_BYTES`` bytes: 128 FP8 codes, then its scale as a float32. The scale is a power of two, so scaling is exact
and every path (GPU, Triton's interpreter, the torch path) gives the same bits: the smallest 2^e with
``absmax / 2^e <=`` the format's largest finite value, e clamped to [-126, 126] so 2^e and 2^-e are both normal
float32 numbers (a finite float32 block never needs more than 2^120).

Encoding rounds to nearest, ties to even, with integer arithmetic (Triton's interpreter does not round float8
conversions the GPU's way); ``tests/unit/kernels/test_wire_kernels.py`` checks it against
``tensor.to(torch.float8_*)``. A block with a non-finite value is sent as all NaN (code 0x7F, torch's NaN for both
formats) with scale 1, so an overflow reaches every rank's gradients and an overflow check sees it.
"""

# No ``from __future__ import annotations``: Triton 3.0's interpreter needs tl.constexpr annotations as objects.
from dataclasses import dataclass

import torch

from . import _triton

triton, tl = _triton.triton, _triton.tl

#: Elements per scaled block: 128, as DeepSeek-V3's and ZeRO++'s block quantizers use; the scale costs 4/128 bytes
#: per element (3%).
BLOCK_ELEMENTS = 128
#: Bytes of one block on the wire: the codes, then the float32 scale at a 4-byte aligned offset.
ROW_BYTES = BLOCK_ELEMENTS + 4
#: The row in 32-bit words (the scale is word ``ROW_WORDS - 1``).
ROW_WORDS = ROW_BYTES // 4
#: The NaN code written for a non-finite block (torch's NaN for both formats).
NAN_CODE = 0x7F
#: Scale exponents are clamped here so that 2^e and 2^-e are normal float32 numbers.
MIN_EXPONENT, MAX_EXPONENT = -126, 126


@dataclass(frozen=True)
class Fp8Format:
    """The bit layout of one FP8 format, as the kernels' constexprs."""

    dtype: torch.dtype
    mantissa_bits: int
    bias: int
    max_exponent: int
    """Exponent of the largest finite value, which is 1.75 * 2^max_exponent in both formats."""

    @property
    def max_finite(self) -> float:
        return 1.75 * 2.0**self.max_exponent


E4M3 = Fp8Format(torch.float8_e4m3fn, mantissa_bits=3, bias=7, max_exponent=8)
E5M2 = Fp8Format(torch.float8_e5m2, mantissa_bits=2, bias=15, max_exponent=15)
FORMATS = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}


if _triton.AVAILABLE:

    @triton.jit
    def _block_exponent(values, MAX_EXPONENT_OF: tl.constexpr):
        """(e, finite) for a block of float32 ``values``: the smallest power-of-two scale exponent that fits the
        block's largest magnitude under 1.75 * 2^MAX_EXPONENT_OF, clamped to [-126, 126]. Integer arithmetic on the
        magnitudes' bits: float max/min disagree on NaN between the GPU and the interpreter, integers do not."""
        magnitude = (values.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        largest = tl.max(magnitude, axis=0)
        finite = largest < 0x7F800000
        exponent = (largest >> 23) - 127 - MAX_EXPONENT_OF + ((largest & 0x7FFFFF) > 0x600000).to(tl.int32)
        exponent = tl.minimum(tl.maximum(exponent, -126), 126)
        return tl.where(finite, exponent, 0), finite

    @triton.jit
    def _power_of_two(exponent):
        """2^exponent as float32, for exponent in [-126, 126]."""
        return ((exponent + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _encode(values, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
        """float32 values with |v| <= the format's largest finite value -> FP8 codes (int32), nearest-even."""
        bits = values.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        magnitude = bits & 0x7FFFFFFF
        SHIFT: tl.constexpr = 23 - MANTISSA
        # Normal results: round the mantissa to MANTISSA bits, then move the exponent to the FP8 bias.
        lsb = (magnitude >> SHIFT) & 1
        normal = ((magnitude + ((1 << (SHIFT - 1)) - 1) + lsb) >> SHIFT) - ((127 - BIAS) << MANTISSA)
        # Subnormal results: the significand shifted right by how far the value lies below FP8's smallest normal.
        biased = magnitude >> 23
        significand = (magnitude & 0x7FFFFF) | tl.where(biased > 0, 0x800000, 0)
        shift = tl.minimum((SHIFT + 1) + (127 - BIAS) - biased, 25)  # from 25 on, everything rounds to 0
        shift = tl.maximum(shift, 1)
        truncated = significand >> shift
        remainder = significand & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        round_up = (remainder > half) | ((remainder == half) & ((truncated & 1) == 1))
        subnormal = truncated + round_up.to(tl.int32)
        code = tl.where(biased >= 128 - BIAS, normal, subnormal)
        return code | sign

    @triton.jit
    def _decode(codes, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
        """FP8 codes (int32, 0..255) -> float32, exactly; 0x7F/0xFF (and E5M2's inf/NaN codes) as such."""
        sign = (codes & 0x80) << 24
        EXPONENT_MASK: tl.constexpr = (0x7F >> MANTISSA)
        exponent = (codes >> MANTISSA) & EXPONENT_MASK
        mantissa = codes & ((1 << MANTISSA) - 1)
        normal_bits = ((exponent + (127 - BIAS)) << 23) | (mantissa << (23 - MANTISSA))
        # Subnormals: mantissa * 2^(1 - BIAS - MANTISSA): the small integer as float32, its exponent field lowered.
        as_float = mantissa.to(tl.float32).to(tl.int32, bitcast=True)
        subnormal_bits = tl.where(mantissa == 0, 0, as_float + ((1 - BIAS - MANTISSA) << 23))
        magnitude = tl.where(exponent == 0, subnormal_bits, normal_bits)
        if MANTISSA == 3:  # E4M3FN: no infinities, 0x7F/0xFF are NaN
            magnitude = tl.where((codes & 0x7F) == 0x7F, 0x7FC00000, magnitude)
        else:  # E5M2: IEEE-like, exponent 31 is inf (mantissa 0) or NaN
            magnitude = tl.where(exponent == EXPONENT_MASK,
                                 tl.where(mantissa == 0, 0x7F800000, 0x7FC00000), magnitude)
        return (magnitude | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _quantize_block(values, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MAX_EXPONENT_OF: tl.constexpr):
        """A block of float32 values -> (codes, scale, dequantized values, finite)."""
        exponent, finite = _block_exponent(values, MAX_EXPONENT_OF)
        codes = _encode(values * _power_of_two(-exponent), MANTISSA, BIAS)
        codes = tl.where(finite, codes, 0x7F)
        scale = _power_of_two(exponent)
        dequantized = _decode(codes, MANTISSA, BIAS) * scale
        return codes, scale, dequantized, finite
