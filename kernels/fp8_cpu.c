/* Block-scaled FP8 on the CPU: the three passes of kernels/blockscale.py, fused, with the Triton kernels' bits.
 *
 * The torch path (kernels/torch_wire.py) needs about ten passes over memory per element, three of them FP8
 * conversions torch does element by element; here each pass is one sweep per 128-element block, in the integer
 * arithmetic of kernels/fp8.py (_block_exponent, _encode, _decode), branch-free so that the compiler vectorises it.
 * kernels/native_cpu.py compiles this file on first use with -ffp-contract=off: a fused multiply-add would round
 * once where the kernels round twice. The exported functions are specialised per format (the _e4m3 and _e5m2 ends).
 *
 * Rows are 132 bytes: 128 codes, then the block's scale as a float32 (kernels/fp8.py). Where each row's elements
 * lie in the bucket comes from the layout's block table, (first element, length) per row, as the kernels read it:
 * each tensor has its own blocks, its last one short, and padding rows have length 0.
 *
 * The error-feedback residual is float32 or bfloat16 (residual_bf16): a bfloat16 one is widened exactly to add and
 * what is left, computed in float32 as for a float32 one, is rounded once to store (nearest, ties to even, as
 * kernels/convert.py's _fp32_to_bf16_bits). Each pass is compiled once per residual dtype, so the float32 one keeps
 * its loops.
 */

#include <stdint.h>
#include <string.h>

#define BLOCK 128
#define ROW_BYTES 132
#define NAN_CODE 0x7F
#define CANONICAL_NAN 0x7FC00000u
#define INLINE static inline __attribute__((always_inline))

INLINE uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE float power_of_two(int32_t e) { return float_of((uint32_t)(e + 127) << 23); }
INLINE float row_scale(const uint8_t *row) { float s; memcpy(&s, row + BLOCK, 4); return s; }
INLINE float widen_bf16(uint16_t h) { return float_of((uint32_t)h << 16); }
/* float32 -> bfloat16 bits, nearest-even (a carry out of the mantissa bumps the exponent); NaN: 0x7FC0. */
INLINE uint16_t round_to_bf16(float f) {
    uint32_t u = bits_of(f);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

/* float32 with |v| <= the format's largest finite value -> its code, nearest-even (fp8.py's _encode). */
INLINE uint32_t encode(float v, const int M, const int BIAS) {
    const int32_t SHIFT = 23 - M;
    uint32_t u = bits_of(v);
    uint32_t sign = (u >> 24) & 0x80;
    int32_t magnitude = (int32_t)(u & 0x7FFFFFFF);
    int32_t lsb = (magnitude >> SHIFT) & 1;
    int32_t normal = ((magnitude + ((1 << (SHIFT - 1)) - 1) + lsb) >> SHIFT) - ((127 - BIAS) << M);
    int32_t biased = magnitude >> 23;
    int32_t significand = (magnitude & 0x7FFFFF) | (biased > 0 ? 0x800000 : 0);
    int32_t shift = (SHIFT + 1) + (127 - BIAS) - biased;
    shift = shift > 25 ? 25 : shift;
    shift = shift < 1 ? 1 : shift;
    int32_t truncated = significand >> shift;
    int32_t remainder = significand & ((1 << shift) - 1);
    int32_t half = 1 << (shift - 1);
    int32_t round_up = (remainder > half ? 1 : 0) | ((remainder == half ? truncated : 0) & 1);
    int32_t code = biased >= 128 - BIAS ? normal : truncated + round_up;
    return (uint32_t)code | sign;
}

/* A code -> its float32 value, exactly (fp8.py's _decode). */
INLINE float decode(uint32_t code, const int M, const int BIAS) {
    const uint32_t EXPONENT_MASK = 0x7Fu >> M;
    uint32_t sign = (code & 0x80) << 24;
    uint32_t exponent = (code >> M) & EXPONENT_MASK;
    uint32_t mantissa = code & ((1u << M) - 1);
    uint32_t normal = ((exponent + (127 - BIAS)) << 23) | (mantissa << (23 - M));
    uint32_t as_float = bits_of((float)(int32_t)mantissa);
    uint32_t subnormal = mantissa == 0 ? 0 : as_float - ((uint32_t)(BIAS + M - 1) << 23);
    uint32_t magnitude = exponent == 0 ? subnormal : normal;
    if (M == 3)  /* E4M3FN: no infinities, 0x7F/0xFF are NaN */
        magnitude = (code & 0x7F) == 0x7F ? CANONICAL_NAN : magnitude;
    else  /* E5M2: the top exponent is inf (mantissa 0) or NaN */
        magnitude = exponent == EXPONENT_MASK ? (mantissa == 0 ? 0x7F800000u : CANONICAL_NAN) : magnitude;
    return float_of(magnitude | sign);
}

/* One block of float32 values -> its row (codes, then scale); left, if not NULL, <- what the rounding left out,
 * 0 in a non-finite block (fp8.py's _quantize_block). */
INLINE void quantize_block(const float *values, uint8_t *row, float *left, const int M, const int BIAS,
                           const int MAX_EXPONENT_OF) {
    uint32_t largest = 0;
    for (int i = 0; i < BLOCK; i++) {
        uint32_t magnitude = bits_of(values[i]) & 0x7FFFFFFF;
        largest = magnitude > largest ? magnitude : largest;
    }
    float scale = 1.0f;
    if (largest >= 0x7F800000u) {
        memset(row, NAN_CODE, BLOCK);
        if (left)
            memset(left, 0, BLOCK * sizeof(float));
    } else {
        int32_t e = (int32_t)(largest >> 23) - 127 - MAX_EXPONENT_OF + ((largest & 0x7FFFFF) > 0x600000);
        e = e < -126 ? -126 : (e > 126 ? 126 : e);
        float inverse = power_of_two(-e);
        scale = power_of_two(e);
        uint8_t codes[BLOCK];
        for (int i = 0; i < BLOCK; i++)
            codes[i] = (uint8_t)encode(values[i] * inverse, M, BIAS);
        memcpy(row, codes, BLOCK);
        if (left)
            for (int i = 0; i < BLOCK; i++)
                left[i] = values[i] - decode(codes[i], M, BIAS) * scale;
    }
    memcpy(row + BLOCK, &scale, 4);
}

INLINE void quantize(const float *src, int64_t src_offset, const int64_t *table, int64_t n_rows, float scale,
                     int apply_scale, void *residual_at, uint8_t *rows, const int M, const int BIAS,
                     const int MAX_EXPONENT_OF, const int RESIDUAL_BF16) {
    float values[BLOCK], left[BLOCK], widened[BLOCK];
    float *residual32 = RESIDUAL_BF16 ? NULL : (float *)residual_at;
    uint16_t *residual16 = RESIDUAL_BF16 ? (uint16_t *)residual_at : NULL;
    for (int64_t r = 0; r < n_rows; r++) {
        int64_t start = table[2 * r], length = table[2 * r + 1];
        const float *x = length > 0 ? src + (start - src_offset) : src;  /* a padding row reads nothing */
        const float *residual = NULL;  /* this block's residual as float32 */
        if (residual16) {
            for (int64_t i = 0; i < length; i++)
                widened[i] = widen_bf16(residual16[start + i]);
            residual = widened;
        } else if (residual32) {
            residual = residual32 + start;
        }
        if (length == BLOCK) {  /* the kernel's order: widened value * scale, then + residual */
            if (apply_scale && residual)
                for (int i = 0; i < BLOCK; i++) values[i] = x[i] * scale + residual[i];
            else if (apply_scale)
                for (int i = 0; i < BLOCK; i++) values[i] = x[i] * scale;
            else if (residual)
                for (int i = 0; i < BLOCK; i++) values[i] = x[i] + residual[i];
            else
                memcpy(values, x, sizeof(values));
        } else {  /* a tensor's short last block, or a padding row (length 0): zeros past its end */
            for (int i = 0; i < BLOCK; i++)
                values[i] = 0.0f;
            for (int64_t i = 0; i < length; i++) {
                float v = x[i];
                if (apply_scale)
                    v = v * scale;
                if (residual)
                    v = v + residual[i];
                values[i] = v;
            }
        }
        if (residual32 && length == BLOCK) {
            quantize_block(values, rows + r * ROW_BYTES, residual32 + start, M, BIAS, MAX_EXPONENT_OF);
        } else {
            quantize_block(values, rows + r * ROW_BYTES, residual ? left : NULL, M, BIAS, MAX_EXPONENT_OF);
            if (residual16)
                for (int64_t i = 0; i < length; i++)
                    residual16[start + i] = round_to_bf16(left[i]);
            else if (residual32 && length > 0)
                memcpy(residual32 + start, left, (size_t)length * sizeof(float));
        }
    }
}

INLINE void reduce(const uint8_t *received, int64_t rows_per_rank, int64_t n_ranks, void *residual_at,
                   uint8_t *out, const int M, const int BIAS, const int MAX_EXPONENT_OF, const int RESIDUAL_BF16) {
    float total[BLOCK], left[BLOCK];
    for (int64_t r = 0; r < rows_per_rank; r++) {
        for (int i = 0; i < BLOCK; i++)
            total[i] = 0.0f;  /* +0: a -0 from every rank sums to +0, as in the kernel */
        for (int64_t k = 0; k < n_ranks; k++) {
            const uint8_t *row = received + (k * rows_per_rank + r) * ROW_BYTES;
            float scale = row_scale(row);
            for (int i = 0; i < BLOCK; i++)
                total[i] = total[i] + decode(row[i], M, BIAS) * scale;  /* an exact product: one rounding */
        }
        if (RESIDUAL_BF16 && residual_at) {
            uint16_t *block_residual = (uint16_t *)residual_at + r * BLOCK;
            for (int i = 0; i < BLOCK; i++)
                total[i] = total[i] + widen_bf16(block_residual[i]);
            quantize_block(total, out + r * ROW_BYTES, left, M, BIAS, MAX_EXPONENT_OF);
            for (int i = 0; i < BLOCK; i++)
                block_residual[i] = round_to_bf16(left[i]);
            continue;
        }
        float *block_residual = residual_at ? (float *)residual_at + r * BLOCK : NULL;
        if (block_residual)
            for (int i = 0; i < BLOCK; i++)
                total[i] = total[i] + block_residual[i];
        quantize_block(total, out + r * ROW_BYTES, block_residual, M, BIAS, MAX_EXPONENT_OF);
    }
}

INLINE void dequantize(const uint8_t *rows, const int64_t *table, int64_t n_rows, float *dst, int64_t dst_offset,
                       int canonical_nan, const int M, const int BIAS) {
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *row = rows + r * ROW_BYTES;
        float scale = row_scale(row);
        int64_t length = table[2 * r + 1];
        float *out = length > 0 ? dst + (table[2 * r] - dst_offset) : dst;
        if (length == BLOCK) {
            for (int i = 0; i < BLOCK; i++) {
                float v = decode(row[i], M, BIAS) * scale;
                out[i] = canonical_nan && v != v ? float_of(CANONICAL_NAN) : v;
            }
        } else {
            for (int64_t i = 0; i < length; i++) {
                float v = decode(row[i], M, BIAS) * scale;
                out[i] = canonical_nan && v != v ? float_of(CANONICAL_NAN) : v;
            }
        }
    }
}

/* rows <- the blocks of src * scale (+ residual), each row's (first element, length) in table (n_rows pairs; a
 * short block is zero past its end); residual <- what the rounding left out. src holds the bucket's elements from
 * src_offset on; residual the whole bucket, float32 or (residual_bf16) bfloat16. */
void ddpt_quantize_e4m3(const float *src, int64_t src_offset, const int64_t *table, int64_t n_rows, float scale,
                        int apply_scale, void *residual, int residual_bf16, uint8_t *rows) {
    if (residual_bf16)
        quantize(src, src_offset, table, n_rows, scale, apply_scale, residual, rows, 3, 7, 8, 1);
    else
        quantize(src, src_offset, table, n_rows, scale, apply_scale, residual, rows, 3, 7, 8, 0);
}
void ddpt_quantize_e5m2(const float *src, int64_t src_offset, const int64_t *table, int64_t n_rows, float scale,
                        int apply_scale, void *residual, int residual_bf16, uint8_t *rows) {
    if (residual_bf16)
        quantize(src, src_offset, table, n_rows, scale, apply_scale, residual, rows, 2, 15, 15, 1);
    else
        quantize(src, src_offset, table, n_rows, scale, apply_scale, residual, rows, 2, 15, 15, 0);
}

/* out <- the requantized sum, in float32 from +0 in rank order, of n_ranks copies of rows_per_rank rows laid rank
 * after rank in received (+ residual, 128 per row, float32 or (residual_bf16) bfloat16); residual <- what the
 * rounding left out. */
void ddpt_reduce_e4m3(const uint8_t *received, int64_t rows_per_rank, int64_t n_ranks, void *residual,
                      int residual_bf16, uint8_t *out) {
    if (residual_bf16)
        reduce(received, rows_per_rank, n_ranks, residual, out, 3, 7, 8, 1);
    else
        reduce(received, rows_per_rank, n_ranks, residual, out, 3, 7, 8, 0);
}
void ddpt_reduce_e5m2(const uint8_t *received, int64_t rows_per_rank, int64_t n_ranks, void *residual,
                      int residual_bf16, uint8_t *out) {
    if (residual_bf16)
        reduce(received, rows_per_rank, n_ranks, residual, out, 2, 15, 15, 1);
    else
        reduce(received, rows_per_rank, n_ranks, residual, out, 2, 15, 15, 0);
}

/* dst <- the values of n_rows rows, each where table (first element, length) says; dst holds the bucket's
 * elements from dst_offset on. NaNs canonical if asked. */
void ddpt_dequantize_e4m3(const uint8_t *rows, const int64_t *table, int64_t n_rows, float *dst, int64_t dst_offset,
                          int canonical_nan) {
    dequantize(rows, table, n_rows, dst, dst_offset, canonical_nan, 3, 7);
}
void ddpt_dequantize_e5m2(const uint8_t *rows, const int64_t *table, int64_t n_rows, float *dst, int64_t dst_offset,
                          int canonical_nan) {
    dequantize(rows, table, n_rows, dst, dst_offset, canonical_nan, 2, 15);
}
