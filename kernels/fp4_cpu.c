/* Block-scaled E2M1 (4-bit) on the CPU: the passes of kernels/blockscale.py with fmt=FP4_E2M1, fused, with the
 * Triton kernels' bits (kernels/fp4.py).
 *
 * The torch path (kernels/torch_fp4.py) takes a dozen passes over memory per element; here each pass is one sweep
 * per 128-element block, in the arithmetic of kernels/fp4.py (_group_exponents, _encode, _decode), branch-free so
 * that the compiler vectorises it. kernels/native_cpu.py compiles this file with fp8_cpu.c into one library, with
 * -ffp-contract=off: a fused multiply-add would round once where the kernels round twice.
 *
 * Rows are 68 bytes: 128 codes two to a byte (element 2i in the low nibble of byte i), then one E8M0 scale byte per
 * group of 32 (2^(byte - 127); 0xFF: the block was not finite, every value NaN). Where each row's elements lie in
 * the bucket comes from the layout's block table, (first element, length) per row, as the kernels read it: each
 * tensor has its own blocks, its last one short, and padding rows have length 0.
 *
 * The error-feedback residual is float32 or bfloat16 (residual_bf16), as in fp8_cpu.c: a bfloat16 one is widened
 * exactly to add and what is left, computed in float32, is rounded once to store (nearest, ties to even).
 */

#include <stdint.h>
#include <string.h>

#define BLOCK 128
#define GROUP 32
#define GROUPS (BLOCK / GROUP)
#define CODE_BYTES (BLOCK / 2)
#define ROW_BYTES (CODE_BYTES + GROUPS)
#define NAN_SCALE 0xFF
#define CANONICAL_NAN 0x7FC00000u
#define INLINE static inline __attribute__((always_inline))

INLINE uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE float power_of_two(int32_t e) { return float_of((uint32_t)(e + 127) << 23); }
INLINE float widen_bf16(uint16_t h) { return float_of((uint32_t)h << 16); }
/* float32 -> bfloat16 bits, nearest-even (a carry out of the mantissa bumps the exponent); NaN: 0x7FC0. */
INLINE uint16_t round_to_bf16(float f) {
    uint32_t u = bits_of(f);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

/* float32 with |v| <= 6 -> its E2M1 code (0-15): the nearest magnitude by the midpoints, ties to the even code,
 * the sign bit kept (fp4.py's _encode). */
INLINE uint32_t encode(float v) {
    float a = float_of(bits_of(v) & 0x7FFFFFFF);
    uint32_t code = (uint32_t)(a > 0.25f) + (uint32_t)(a >= 0.75f) + (uint32_t)(a > 1.25f) + (uint32_t)(a >= 1.75f)
                    + (uint32_t)(a > 2.5f) + (uint32_t)(a >= 3.5f) + (uint32_t)(a > 5.0f);
    return code | ((bits_of(v) >> 28) & 8);
}

/* A code (0-15) -> its float32 value, exactly (fp4.py's _decode). */
INLINE float decode(uint32_t code) {
    uint32_t exponent = (code >> 1) & 3, mantissa = code & 1;
    uint32_t magnitude = exponent == 0 ? mantissa * 0x3F000000u : ((exponent + 126) << 23) | (mantissa << 22);
    return float_of(magnitude | ((code & 8) << 28));
}

/* One block of float32 values -> its row (codes, then scale bytes); left, if not NULL, <- what the rounding left
 * out, 0 in a non-finite block (fp4.py's _quantize_block). */
INLINE void quantize_block(const float *values, uint8_t *row, float *left) {
    uint32_t largest[GROUPS], top = 0;
    for (int g = 0; g < GROUPS; g++) {
        uint32_t m = 0;
        for (int i = 0; i < GROUP; i++) {
            uint32_t magnitude = bits_of(values[g * GROUP + i]) & 0x7FFFFFFF;
            m = magnitude > m ? magnitude : m;
        }
        largest[g] = m;
        top = m > top ? m : top;
    }
    if (top >= 0x7F800000u) {
        memset(row, 0, CODE_BYTES);
        memset(row + CODE_BYTES, NAN_SCALE, GROUPS);
        if (left)
            memset(left, 0, BLOCK * sizeof(float));
        return;
    }
    uint8_t codes[BLOCK];
    for (int g = 0; g < GROUPS; g++) {
        /* 6 is 1.5 * 2^2: a magnitude whose mantissa is above 1.5's needs one more */
        int32_t e = (int32_t)(largest[g] >> 23) - 127 - 2 + ((largest[g] & 0x7FFFFF) > 0x400000);
        e = e < -126 ? -126 : (e > 126 ? 126 : e);
        float inverse = power_of_two(-e), scale = power_of_two(e);
        const float *v = values + g * GROUP;
        uint8_t *c = codes + g * GROUP;
        for (int i = 0; i < GROUP; i++)
            c[i] = (uint8_t)encode(v[i] * inverse);
        if (left)
            for (int i = 0; i < GROUP; i++)
                left[g * GROUP + i] = v[i] - decode(c[i]) * scale;
        row[CODE_BYTES + g] = (uint8_t)(e + 127);
    }
    for (int i = 0; i < CODE_BYTES; i++)
        row[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
}

/* One row -> its 128 float32 values (ADD: added to values, values[i] + value): each code times its group's scale;
 * canonical NaN in a group scaled 0xFF (fp4.py's _dequantize_row). */
INLINE void decode_row(const uint8_t *row, float *values, const int ADD) {
    uint8_t codes[BLOCK];
    for (int i = 0; i < CODE_BYTES; i++) {
        codes[2 * i] = row[i] & 15;
        codes[2 * i + 1] = row[i] >> 4;
    }
    for (int g = 0; g < GROUPS; g++) {
        uint32_t scale_byte = row[CODE_BYTES + g];
        float scale = float_of(scale_byte << 23);
        float *v = values + g * GROUP;
        const uint8_t *c = codes + g * GROUP;
        if (scale_byte == NAN_SCALE && ADD)
            for (int i = 0; i < GROUP; i++)
                v[i] = v[i] + float_of(CANONICAL_NAN);
        else if (scale_byte == NAN_SCALE)
            for (int i = 0; i < GROUP; i++)
                v[i] = float_of(CANONICAL_NAN);
        else if (ADD)
            for (int i = 0; i < GROUP; i++)
                v[i] = v[i] + decode(c[i]) * scale;
        else
            for (int i = 0; i < GROUP; i++)
                v[i] = decode(c[i]) * scale;
    }
}

INLINE void quantize(const float *src, int64_t src_offset, const int64_t *table, int64_t n_rows, float scale,
                     int apply_scale, void *residual_at, uint8_t *rows, const int RESIDUAL_BF16) {
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
            quantize_block(values, rows + r * ROW_BYTES, residual32 + start);
        } else {
            quantize_block(values, rows + r * ROW_BYTES, residual ? left : NULL);
            if (residual16)
                for (int64_t i = 0; i < length; i++)
                    residual16[start + i] = round_to_bf16(left[i]);
            else if (residual32 && length > 0)
                memcpy(residual32 + start, left, (size_t)length * sizeof(float));
        }
    }
}

INLINE void reduce(const uint8_t *received, int64_t rows_per_rank, int64_t n_ranks, void *residual_at,
                   uint8_t *out, const int RESIDUAL_BF16) {
    float total[BLOCK], left[BLOCK];
    for (int64_t r = 0; r < rows_per_rank; r++) {
        for (int i = 0; i < BLOCK; i++)
            total[i] = 0.0f;  /* +0: a -0 from every rank sums to +0, as in the kernel */
        for (int64_t k = 0; k < n_ranks; k++)
            decode_row(received + (k * rows_per_rank + r) * ROW_BYTES, total, 1);
        if (RESIDUAL_BF16 && residual_at) {
            uint16_t *block_residual = (uint16_t *)residual_at + r * BLOCK;
            for (int i = 0; i < BLOCK; i++)
                total[i] = total[i] + widen_bf16(block_residual[i]);
            quantize_block(total, out + r * ROW_BYTES, left);
            for (int i = 0; i < BLOCK; i++)
                block_residual[i] = round_to_bf16(left[i]);
            continue;
        }
        float *block_residual = residual_at ? (float *)residual_at + r * BLOCK : NULL;
        if (block_residual)
            for (int i = 0; i < BLOCK; i++)
                total[i] = total[i] + block_residual[i];
        quantize_block(total, out + r * ROW_BYTES, block_residual);
    }
}

/* rows <- the blocks of src * scale (+ residual), each row's (first element, length) in table (n_rows pairs; a
 * short block is zero past its end); residual <- what the rounding left out. src holds the bucket's elements from
 * src_offset on; residual the whole bucket, float32 or (residual_bf16) bfloat16. */
void ddpt_quantize_e2m1(const float *src, int64_t src_offset, const int64_t *table, int64_t n_rows, float scale,
                        int apply_scale, void *residual, int residual_bf16, uint8_t *rows) {
    if (residual_bf16)
        quantize(src, src_offset, table, n_rows, scale, apply_scale, residual, rows, 1);
    else
        quantize(src, src_offset, table, n_rows, scale, apply_scale, residual, rows, 0);
}

/* out <- the requantized sum, in float32 from +0 in rank order, of n_ranks copies of rows_per_rank rows laid rank
 * after rank in received (+ residual, 128 per row, float32 or (residual_bf16) bfloat16); residual <- what the
 * rounding left out. */
void ddpt_reduce_e2m1(const uint8_t *received, int64_t rows_per_rank, int64_t n_ranks, void *residual,
                      int residual_bf16, uint8_t *out) {
    if (residual_bf16)
        reduce(received, rows_per_rank, n_ranks, residual, out, 1);
    else
        reduce(received, rows_per_rank, n_ranks, residual, out, 0);
}

/* dst <- the values of n_rows rows, each where table (first element, length) says; dst holds the bucket's
 * elements from dst_offset on. A non-finite block's NaNs are canonical (the only NaNs a row decodes to), so
 * canonical_nan changes nothing: taken for the FP8 passes' signature. */
void ddpt_dequantize_e2m1(const uint8_t *rows, const int64_t *table, int64_t n_rows, float *dst, int64_t dst_offset,
                          int canonical_nan) {
    (void)canonical_nan;
    float values[BLOCK];
    for (int64_t r = 0; r < n_rows; r++) {
        int64_t length = table[2 * r + 1];
        float *out = length > 0 ? dst + (table[2 * r] - dst_offset) : dst;
        if (length == BLOCK) {
            decode_row(rows + r * ROW_BYTES, out, 0);
        } else if (length > 0) {
            decode_row(rows + r * ROW_BYTES, values, 0);
            memcpy(out, values, (size_t)length * sizeof(float));
        }
    }
}
