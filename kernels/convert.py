"""The Triton kernels behind pack and unpack: a flat work list of (source, destination, length) blocks, and its
special case of one contiguous run (a DDP bucket), whose block offsets follow from the program id.

Each program converts one block: it reads ``length <= BLOCK`` elements at ``src_base + src_offset``, multiplies by
``scale`` in float32, rounds once (round-to-nearest-even) to the destination dtype and writes the bit pattern at
``dst_base + dst_offset``. Offsets are int64 element offsets relative to the base pointers, so one launch can gather
from (pack) or scatter to (unpack) any number of tensors of one dtype, wherever they live, without a grid of
(blocks x tensors) programs that mostly idle.

On the GPU, narrowing is the hardware's round-to-nearest-even (``cvt.rn``). Triton's interpreter truncates float32 ->
bfloat16 instead, so there (``HW_CONVERT`` off) bfloat16 rounding is written with integer arithmetic: GPU,
interpreter and the torch path agree to the bit. Every NaN becomes the canonical quiet
NaN of the destination dtype (torch itself is not consistent here: its scalar CPU path, vectorised CPU path and CUDA
path give three different NaN bit patterns).
"""

# No ``from __future__ import annotations`` here: Triton 3.0's interpreter recognises constexpr parameters only by an
# annotation that evaluates to ``tl.constexpr``, not by its text.
from . import _triton

triton, tl = _triton.triton, _triton.tl

# Destination kinds, a constexpr of the kernel. The destination is always written through an integer view.
OUT_BF16 = 0
OUT_FP16 = 1
OUT_FP32 = 2

# Canonical quiet NaNs written for any NaN: the payload-free, positive quiet NaN of each format.
NAN_BITS = {OUT_BF16: 0x7FC0, OUT_FP16: 0x7E00, OUT_FP32: 0x7FC00000}

# Full blocks whose offsets are multiples of ALIGN elements get 16-byte vector accesses (16 elements covers both
# 4-byte and 2-byte dtypes); partial and misaligned blocks take the masked path, with scalar accesses.
ALIGN = tl.constexpr(16) if _triton.AVAILABLE else 16

if _triton.AVAILABLE:

    @triton.jit
    def _fp32_to_bf16_bits(x):
        """Round float32 to bfloat16 (nearest, ties to even) with integer arithmetic; the 16 bits as int16."""
        bits = x.to(tl.uint32, bitcast=True)
        lsb = (bits >> 16) & 1
        rounded = (bits + 0x7FFF + lsb) >> 16  # a carry out of the mantissa correctly bumps the exponent
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.int16, bitcast=True)

    @triton.jit
    def _bf16_bits_to_fp32(bits):
        """Widen bfloat16 bits (int16) to float32 exactly; the interpreter's own widening mangles subnormals."""
        return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _load_fp32(ptr, mask, SRC_BF16: tl.constexpr, MASKED: tl.constexpr):
        """Load source elements as float32; bfloat16 sources arrive as their int16 bits."""
        if MASKED:
            raw = tl.load(ptr, mask=mask, other=0)
        else:
            raw = tl.load(ptr)
        if SRC_BF16:
            return _bf16_bits_to_fp32(raw)
        return raw.to(tl.float32)

    @triton.jit
    def _store_fp32(ptr, x, mask, DST_BF16: tl.constexpr):
        """Store float32 values as they are, or rounded once to bfloat16 (nearest, ties to even; NaN as 0x7FC0)
        through the destination's int16 bits: integer arithmetic on every path, so the GPU's bits are the
        interpreter's and the CPU passes'."""
        if DST_BF16:
            tl.store(ptr, _fp32_to_bf16_bits(x), mask=mask)
        else:
            tl.store(ptr, x, mask=mask)

    @triton.jit
    def _convert(x, scale, APPLY_SCALE: tl.constexpr, OUT_KIND: tl.constexpr, HW_CONVERT: tl.constexpr):
        """float32 values -> (destination bit pattern, float32 value of what is stored).

        With HW_CONVERT (compiled for a GPU) the narrowing is the hardware's ``cvt.rn`` and NaNs are canonicalised by
        a select; without it (the interpreter, which truncates) bfloat16 is rounded with integer arithmetic. Both
        give the same bits.
        """
        if APPLY_SCALE:
            x = x * scale
        if OUT_KIND == 0:
            if HW_CONVERT:
                narrow = x.to(tl.bfloat16, fp_downcast_rounding="rtne")
                bits = tl.where(x != x, 0x7FC0, narrow.to(tl.int16, bitcast=True).to(tl.int32)).to(tl.int16)
                stored = narrow.to(tl.float32)
            else:
                bits = _fp32_to_bf16_bits(x)
                stored = _bf16_bits_to_fp32(bits)
        elif OUT_KIND == 1:
            half = x.to(tl.float16)  # cvt.rn on the GPU, numpy's round-to-nearest-even in the interpreter
            bits = tl.where(x != x, 0x7E00, half.to(tl.int16, bitcast=True).to(tl.int32)).to(tl.int16)
            stored = half.to(tl.float32)
        else:
            bits = tl.where(x != x, 0x7FC00000, x.to(tl.int32, bitcast=True))
            stored = x
        return bits, stored

    @triton.jit
    def _write_stats(stats, item, stored):
        """One partial per block (sum of squares, non-finite count), summed later in a fixed order: no atomics."""
        nonfinite = (stored != stored) | (tl.abs(stored) == float("inf"))
        tl.store(stats + item * 2, tl.sum(stored * stored, axis=0))
        tl.store(stats + item * 2 + 1, tl.sum(nonfinite.to(tl.float32), axis=0))

    @triton.jit
    def _convert_full_block(src, dst, item, scale, stats, APPLY_SCALE: tl.constexpr, SRC_BF16: tl.constexpr,
                            OUT_KIND: tl.constexpr, STATS: tl.constexpr, HW_CONVERT: tl.constexpr):
        """A whole block, unmasked: the caller proves the pointers' alignment, so the accesses vectorise."""
        bits, stored = _convert(_load_fp32(src, None, SRC_BF16, False), scale, APPLY_SCALE, OUT_KIND, HW_CONVERT)
        tl.store(dst, bits)
        if STATS:
            _write_stats(stats, item, stored)

    @triton.jit
    def _convert_masked_block(src, dst, length, item, scale, stats, BLOCK: tl.constexpr, APPLY_SCALE: tl.constexpr,
                              SRC_BF16: tl.constexpr, OUT_KIND: tl.constexpr, STATS: tl.constexpr,
                              HW_CONVERT: tl.constexpr):
        """The first ``length <= BLOCK`` elements, masked, at any alignment: partial and misaligned blocks alike."""
        mask = tl.arange(0, BLOCK) < length  # length is int32: lane compares stay 32-bit
        bits, stored = _convert(_load_fp32(src, mask, SRC_BF16, True), scale, APPLY_SCALE, OUT_KIND, HW_CONVERT)
        tl.store(dst, bits, mask=mask)
        if STATS:
            _write_stats(stats, item, tl.where(mask, stored, 0.0))

    @triton.jit
    def _worklist_convert_kernel(
        src_base,
        dst_base,
        table,
        scale,
        stats,
        BLOCK: tl.constexpr,
        APPLY_SCALE: tl.constexpr,
        SRC_BF16: tl.constexpr,
        OUT_KIND: tl.constexpr,
        STATS: tl.constexpr,
        HW_CONVERT: tl.constexpr,
    ):
        """Any layout: program i converts the block that row i of the work table names."""
        item = tl.program_id(0).to(tl.int64)
        src_offset = tl.load(table + item * 3)
        dst_offset = tl.load(table + item * 3 + 1)
        length = tl.load(table + item * 3 + 2).to(tl.int32)  # <= BLOCK
        lanes = tl.arange(0, BLOCK)
        # Alignment is decided per block, so one oddly sized tensor does not cost the others their vector accesses.
        if (length == BLOCK) & (src_offset % ALIGN == 0) & (dst_offset % ALIGN == 0):
            # Offsets re-derived as multiples of ALIGN, which the compiler can prove. A multiple_of hint on the loaded
            # values would tag the table load itself: every use of them, the masked path's included, would then be
            # compiled as aligned (more registers there; with an unmasked misaligned path, a misaligned 16-byte fault).
            src_aligned = (src_offset // ALIGN) * ALIGN
            dst_aligned = (dst_offset // ALIGN) * ALIGN
            _convert_full_block(src_base + src_aligned + lanes, dst_base + dst_aligned + lanes, item, scale, stats,
                                APPLY_SCALE, SRC_BF16, OUT_KIND, STATS, HW_CONVERT)
        else:
            _convert_masked_block(src_base + src_offset + lanes, dst_base + dst_offset + lanes, length, item, scale,
                                  stats, BLOCK, APPLY_SCALE, SRC_BF16, OUT_KIND, STATS, HW_CONVERT)

    @triton.jit
    def _contiguous_convert_kernel(
        src,
        dst,
        n_elements,
        scale,
        stats,
        BLOCK: tl.constexpr,
        APPLY_SCALE: tl.constexpr,
        SRC_BF16: tl.constexpr,
        OUT_KIND: tl.constexpr,
        STATS: tl.constexpr,
        HW_CONVERT: tl.constexpr,
    ):
        """One contiguous run (a DDP bucket): block offsets come from the program id, no table to read first."""
        item = tl.program_id(0).to(tl.int64)
        start = item * BLOCK  # a multiple of BLOCK, as the compiler sees: full blocks keep the base's alignment
        lanes = tl.arange(0, BLOCK)
        if start + BLOCK <= n_elements:
            _convert_full_block(src + start + lanes, dst + start + lanes, item, scale, stats,
                                APPLY_SCALE, SRC_BF16, OUT_KIND, STATS, HW_CONVERT)
        else:
            length = (n_elements - start).to(tl.int32)
            _convert_masked_block(src + start + lanes, dst + start + lanes, length, item, scale, stats,
                                  BLOCK, APPLY_SCALE, SRC_BF16, OUT_KIND, STATS, HW_CONVERT)

else:  # pragma: no cover - exercised only where Triton is missing
    _worklist_convert_kernel = _contiguous_convert_kernel = None
