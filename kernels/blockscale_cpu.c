/* Block-scaled FP8 (E4M3, E5M2) and E2M1 on the CPU: the three passes of kernels/blockscale.py, fused, with the
 * Triton kernels' bits.
 *
 * The torch paths (kernels/torch_wire.py, kernels/torch_fp4.py) need about ten passes over memory per element, FP8's
 * conversions among them done by torch element by element; here each pass is one sweep per 128-element block, in the
 * integer arithmetic of kernels/fp8.py and kernels/fp4.py (their block or group exponents, _encode, _decode),
 * branch-free so that the compiler vectorises it. kernels/native_cpu.py compiles this file on first use with
 * -ffp-contract=off: a fused multiply-add would round once where the kernels round twice.
 *
 * The passes are written once for every format: each row's elements gathered from the block table, scaled, the
 * residual added and stored again; the sum over ranks; where each row's values go. They take the format as a
 * constant (FMT, as M, BIAS and RESIDUAL_BF16) and are always inlined, so each exported function is specialised per
 * format (the _e4m3, _e5m2 and _e2m1 ends) and keeps its own straight loops. The formats differ only in one element's
 * code, one block's row and one row's values:
 *
 * - FP8: 132-byte rows, 128 codes, then the block's scale as a float32 (kernels/fp8.py);
 * - E2M1: 68-byte rows, 128 codes two to a byte (element 2i in the low nibble of byte i), then one E8M0 scale byte
 *   per group of 32 (2^(byte - 127); 0xFF: the block was not finite, every value NaN) (kernels/fp4.py).
 *
 * Where each row's elements lie in the bucket comes from the layout's block table, (first element, length) per row,
 * as the kernels read it: each tensor has its own blocks, its last one short, and padding rows have length 0.
 *
 * The error-feedback residual is float32 or bfloat16 (residual_bf16): a bfloat16 one is widened exactly to add and
 * what is left, computed in float32 as for a float32 one, is rounded once to store (nearest, ties to even, as
 * kernels/convert.py's _fp32_to_bf16_bits). Each pass is compiled once per residual dtype, so the float32 one keeps
 * its loops.
 */

#include <stdint.h>
#include <string.h>

#define BLOCK 128
#define CANONICAL_NAN 0x7FC00000u
#define INLINE static inline __attribute__((always_inline))

/* The formats, a constant argument FMT of every pass. */
enum { E4M3, E5M2, E2M1 };

#define FP8_ROW_BYTES (BLOCK + 4)
#define FP8_NAN_CODE 0x7F
#define GROUP 32
#define GROUPS (BLOCK / GROUP)
#define E2M1_CODE_BYTES (BLOCK / 2)
#define E2M1_ROW_BYTES (E2M1_CODE_BYTES + GROUPS)
#define E2M1_NAN_SCALE 0xFF

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

/* ---- FP8: M mantissa bits, exponent bias BIAS, largest finite value below 2^(MAX_EXPONENT_OF + 1) ---- */

INLINE float fp8_row_scale(const uint8_t *row) { float s; memcpy(&s, row + BLOCK, 4); return s; }

/* float32 with |v| <= the format's largest finite value -> its code, nearest-even (fp8.py's _encode). */
INLINE uint32_t fp8_encode(float v, const int M, const int BIAS) {
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
INLINE float fp8_decode(uint32_t code, const int M, const int BIAS) {
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
INLINE void fp8_quantize_block(const float *values, uint8_t *row, float *left, const int M, const int BIAS,
                               const int MAX_EXPONENT_OF) {
    uint32_t largest = 0;
    for (int i = 0; i < BLOCK; i++) {
        uint32_t magnitude = bits_of(values[i]) & 0x7FFFFFFF;
        largest = magnitude > largest ? magnitude : largest;
    }
    float scale = 1.0f;
    if (largest >= 0x7F800000u) {
        memset(row, FP8_NAN_CODE, BLOCK);
        if (left)
            memset(left, 0, BLOCK * sizeof(float));
    } else {
        int32_t e = (int32_t)(largest >> 23) - 127 - MAX_EXPONENT_OF + ((largest & 0x7FFFFF) > 0x600000);
        e = e < -126 ? -126 : (e > 126 ? 126 : e);
        float inverse = power_of_two(-e);
        scale = power_of_two(e);
        uint8_t codes[BLOCK];
        for (int i = 0; i < BLOCK; i++)
            codes[i] = (uint8_t)fp8_encode(values[i] * inverse, M, BIAS);
        memcpy(row, codes, BLOCK);
        if (left)
            for (int i = 0; i < BLOCK; i++)
                left[i] = values[i] - fp8_decode(codes[i], M, BIAS) * scale;
    }
    memcpy(row + BLOCK, &scale, 4);
}

/* One row -> its 128 float32 values (ADD: added to values, values[i] + value): each code times the block's scale,
 * an exact product, so one rounding in the sum; without ADD, NaNs canonical if asked. */
INLINE void fp8_decode_row(const uint8_t *row, float *values, int canonical_nan, const int ADD, const int M,
                           const int BIAS) {
    float scale = fp8_row_scale(row);
    if (ADD)
        for (int i = 0; i < BLOCK; i++)
            values[i] = values[i] + fp8_decode(row[i], M, BIAS) * scale;
    else
        for (int i = 0; i < BLOCK; i++) {
            float v = fp8_decode(row[i], M, BIAS) * scale;
            values[i] = canonical_nan && v != v ? float_of(CANONICAL_NAN) : v;
        }
}

/* ---- E2M1 ---- */

/* float32 with |v| <= 6 -> its E2M1 code (0-15): the nearest magnitude by the midpoints, ties to the even code,
 * the sign bit kept (fp4.py's _encode). */
INLINE uint32_t e2m1_encode(float v) {
    float a = float_of(bits_of(v) & 0x7FFFFFFF);
    uint32_t code = (uint32_t)(a > 0.25f) + (uint32_t)(a >= 0.75f) + (uint32_t)(a > 1.25f) + (uint32_t)(a >= 1.75f)
                    + (uint32_t)(a > 2.5f) + (uint32_t)(a >= 3.5f) + (uint32_t)(a > 5.0f);
    return code | ((bits_of(v) >> 28) & 8);
}

/* A code (0-15) -> its float32 value, exactly (fp4.py's _decode). */
INLINE float e2m1_decode(uint32_t code) {
    uint32_t exponent = (code >> 1) & 3, mantissa = code & 1;
    uint32_t magnitude = exponent == 0 ? mantissa * 0x3F000000u : ((exponent + 126) << 23) | (mantissa << 22);
    return float_of(magnitude | ((code & 8) << 28));
}

/* One block of float32 values -> its row (codes, then scale bytes); left, if not NULL, <- what the rounding left
 * out, 0 in a non-finite block (fp4.py's _quantize_block). */
INLINE void e2m1_quantize_block(const float *values, uint8_t *row, float *left) {
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
        memset(row, 0, E2M1_CODE_BYTES);
        memset(row + E2M1_CODE_BYTES, E2M1_NAN_SCALE, GROUPS);
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
            c[i] = (uint8_t)e2m1_encode(v[i] * inverse);
        if (left)
            for (int i = 0; i < GROUP; i++)
                left[g * GROUP + i] = v[i] - e2m1_decode(c[i]) * scale;
        row[E2M1_CODE_BYTES + g] = (uint8_t)(e + 127);
    }
    for (int i = 0; i < E2M1_CODE_BYTES; i++)
        row[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
}

/* One row -> its 128 float32 values (ADD: added to values, values[i] + value): each code times its group's scale;
 * canonical NaN in a group scaled 0xFF, the only NaNs a row decodes to (fp4.py's _dequantize_row). */
INLINE void e2m1_decode_row(const uint8_t *row, float *values, const int ADD) {
    uint8_t codes[BLOCK];
    for (int i = 0; i < E2M1_CODE_BYTES; i++) {
        codes[2 * i] = row[i] & 15;
        codes[2 * i + 1] = row[i] >> 4;
    }
    for (int g = 0; g < GROUPS; g++) {
        uint32_t scale_byte = row[E2M1_CODE_BYTES + g];
        float scale = float_of(scale_byte << 23);
        float *v = values + g * GROUP;
        const uint8_t *c = codes + g * GROUP;
        if (scale_byte == E2M1_NAN_SCALE && ADD)
            for (int i = 0; i < GROUP; i++)
                v[i] = v[i] + float_of(CANONICAL_NAN);
        else if (scale_byte == E2M1_NAN_SCALE)
            for (int i = 0; i < GROUP; i++)
                v[i] = float_of(CANONICAL_NAN);
        else if (ADD)
            for (int i = 0; i < GROUP; i++)
                v[i] = v[i] + e2m1_decode(c[i]) * scale;
        else
            for (int i = 0; i < GROUP; i++)
                v[i] = e2m1_decode(c[i]) * scale;
    }
}

/* ---- One format's pieces, chosen by FMT at compile time ---- */

INLINE int64_t row_bytes(const int FMT) { return FMT == E2M1 ? E2M1_ROW_BYTES : FP8_ROW_BYTES; }

INLINE void quantize_block(const float *values, uint8_t *row, float *left, const int FMT) {
    if (FMT == E4M3)
        fp8_quantize_block(values, row, left, 3, 7, 8);
    else if (FMT == E5M2)
        fp8_quantize_block(values, row, left, 2, 15, 15);
    else
        e2m1_quantize_block(values, row, left);
}

/* canonical_nan: FP8's NaNs canonical when not ADD (E2M1's always are). */
INLINE void decode_row(const uint8_t *row, float *values, int canonical_nan, const int ADD, const int FMT) {
    if (FMT == E4M3)
        fp8_decode_row(row, values, canonical_nan, ADD, 3, 7);
    else if (FMT == E5M2)
        fp8_decode_row(row, values, canonical_nan, ADD, 2, 15);
    else
        e2m1_decode_row(row, values, ADD);
}

/* ---- The passes, every format ---- */

INLINE void quantize(const float *src, int64_t src_offset, const int64_t *table, int64_t n_rows, float scale,
                     int apply_scale, void *residual_at, uint8_t *rows, const int FMT, const int RESIDUAL_BF16) {
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
        uint8_t *row = rows + r * row_bytes(FMT);
        if (residual32 && length == BLOCK) {
            quantize_block(values, row, residual32 + start, FMT);
        } else {
            quantize_block(values, row, residual ? left : NULL, FMT);
            if (residual16)
                for (int64_t i = 0; i < length; i++)
                    residual16[start + i] = round_to_bf16(left[i]);
            else if (residual32 && length > 0)
                memcpy(residual32 + start, left, (size_t)length * sizeof(float));
        }
    }
}

INLINE void reduce(const uint8_t *received, int64_t rows_per_rank, int64_t n_ranks, void *residual_at,
                   uint8_t *out, const int FMT, const int RESIDUAL_BF16) {
    float total[BLOCK], left[BLOCK];
    for (int64_t r = 0; r < rows_per_rank; r++) {
        for (int i = 0; i < BLOCK; i++)
            total[i] = 0.0f;  /* +0: a -0 from every rank sums to +0, as in the kernel */
        for (int64_t k = 0; k < n_ranks; k++)
            decode_row(received + (k * rows_per_rank + r) * row_bytes(FMT), total, 0, 1, FMT);
        uint8_t *row = out + r * row_bytes(FMT);
        if (RESIDUAL_BF16 && residual_at) {
            uint16_t *block_residual = (uint16_t *)residual_at + r * BLOCK;
            for (int i = 0; i < BLOCK; i++)
                total[i] = total[i] + widen_bf16(block_residual[i]);
            quantize_block(total, row, left, FMT);
            for (int i = 0; i < BLOCK; i++)
                block_residual[i] = round_to_bf16(left[i]);
            continue;
        }
        float *block_residual = residual_at ? (float *)residual_at + r * BLOCK : NULL;
        if (block_residual)
            for (int i = 0; i < BLOCK; i++)
                total[i] = total[i] + block_residual[i];
        quantize_block(total, row, block_residual, FMT);
    }
}

INLINE void dequantize(const uint8_t *rows, const int64_t *table, int64_t n_rows, float *dst, int64_t dst_offset,
                       int canonical_nan, const int FMT) {
    float values[BLOCK];
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *row = rows + r * row_bytes(FMT);
        int64_t length = table[2 * r + 1];
        float *out = length > 0 ? dst + (table[2 * r] - dst_offset) : dst;
        if (length == BLOCK) {
            decode_row(row, out, canonical_nan, 0, FMT);
        } else if (length > 0) {  /* a tensor's short last block: its values only */
            decode_row(row, values, canonical_nan, 0, FMT);
            memcpy(out, values, (size_t)length * sizeof(float));
        }
    }
}

/* The exported passes of one format, NAME its end (ddpt_quantize_e4m3, ...), each residual dtype a call of its own:
 *
 * ddpt_quantize_NAME: rows <- the blocks of src * scale (+ residual), each row's (first element, length) in table
 * (n_rows pairs; a short block is zero past its end); residual <- what the rounding left out. src holds the bucket's
 * elements from src_offset on; residual the whole bucket, float32 or (residual_bf16) bfloat16.
 *
 * ddpt_reduce_NAME: out <- the requantized sum, in float32 from +0 in rank order, of n_ranks copies of rows_per_rank
 * rows laid rank after rank in received (+ residual, 128 per row, float32 or (residual_bf16) bfloat16); residual <-
 * what the rounding left out.
 *
 * ddpt_dequantize_NAME: dst <- the values of n_rows rows, each where table (first element, length) says; dst holds
 * the bucket's elements from dst_offset on. NaNs canonical if asked (E2M1's always are: canonical_nan is taken for
 * one signature in every format). */
#define EXPORT_PASSES(NAME, FMT)                                                                                      \
    void ddpt_quantize_##NAME(const float *src, int64_t src_offset, const int64_t *table, int64_t n_rows,            \
                              float scale, int apply_scale, void *residual, int residual_bf16, uint8_t *rows) {       \
        if (residual_bf16)                                                                                            \
            quantize(src, src_offset, table, n_rows, scale, apply_scale, residual, rows, FMT, 1);                     \
        else                                                                                                          \
            quantize(src, src_offset, table, n_rows, scale, apply_scale, residual, rows, FMT, 0);                     \
    }                                                                                                                 \
    void ddpt_reduce_##NAME(const uint8_t *received, int64_t rows_per_rank, int64_t n_ranks, void *residual,          \
                            int residual_bf16, uint8_t *out) {                                                        \
        if (residual_bf16)                                                                                            \
            reduce(received, rows_per_rank, n_ranks, residual, out, FMT, 1);                                          \
        else                                                                                                          \
            reduce(received, rows_per_rank, n_ranks, residual, out, FMT, 0);                                          \
    }                                                                                                                 \
    void ddpt_dequantize_##NAME(const uint8_t *rows, const int64_t *table, int64_t n_rows, float *dst,                \
                                int64_t dst_offset, int canonical_nan) {                                              \
        dequantize(rows, table, n_rows, dst, dst_offset, canonical_nan, FMT);                                         \
    }

EXPORT_PASSES(e4m3, E4M3)
EXPORT_PASSES(e5m2, E5M2)
EXPORT_PASSES(e2m1, E2M1)
