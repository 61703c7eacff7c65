/* Quantized linears for the CPU path: out = x @ w.T (+ bias), w held in 8 or 4 bits
 * (the W8 and W4 layouts of kernels/quant_reference.py) and never dequantized whole.
 *
 *   w8_linear / w4_linear: the decode shapes (few rows of x). The threads split the
 *       output columns; each streams its weight rows once, R8 (W8) or R (W4) rows at
 *       a time, and dequantizes VL weights at a time in registers (codes, less the
 *       zero point for W4 and asymmetric int8 W8, -> float32, times the scale),
 *       multiplying MT rows of x at once (bfloat16 x on AVX512_BF16 builds:
 *       cpu_quant_bf16.c's instead). AVX2 builds take W8 codes 2 VL a step (W8_PAIRS)
 *       for two weight rows, and W4 codes for one: with 16 vector registers, more
 *       rows' sums spill to the stack.
 *   w8_dequantize / w4_dequantize: rows n0 .. n1 of the weight dequantized into a
 *       panel (float32, bfloat16 or float16), which the launcher multiplies with the
 *       prefill shapes' many rows of x through torch's matmul, panel by panel.
 *
 * Everything multiplies and accumulates in float32 and rounds to the output dtype
 * once. x is first converted to float32 (and, for W4, each group's columns reordered
 * in runs of 2 VL: the even columns, then the odd ones, as a packed byte's low and
 * high nibbles hold them) into a scratch the launcher allocates: [M, K] float32 for
 * W8, [M, K + K / G] for W4 (each row's sums of x per group follow the copy).
 *
 * Layouts (asserted by the launcher, kernels/cpu_quant.py):
 *   x:       [M, K] rows of K contiguous elements, x_stride apart; float32 (kind 0),
 *            bfloat16 (1) or float16 (2)
 *   weight:  [N, K] int8 (kind 0) or float8_e4m3fn (kind 1) bytes, contiguous
 *   scale:   float32 [ceil(N / bn), scale_cols] contiguous, scale_cols = ceil(K / bk):
 *            w[n, k] = weight[n, k] * scale[n / bn, k / bk]
 *   zero:    int8 of scale's shape or NULL (asymmetric int8 weights' zero points):
 *            w[n, k] = (weight[n, k] - zero[n / bn, k / bk]) * scale[n / bn, k / bk],
 *            the difference taken in integers (exact) before the convert to float32
 *   packed:  [N, K / 2] uint8 contiguous, column 2j in byte j's low nibble
 *   scales, zeros: float32 [N, K / G] contiguous (zeros NULL: 8); K % G == 0, G even
 *   bias:    float32 [N] or NULL
 *   out:     [M, N] rows out_stride apart, x's kind; panel: [n1 - n0, K] contiguous
 */
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* w8_linear's fp8 argument: 0 int8 codes, 1 fp8 codes, FP8_FINITE fp8 codes none of
 * which is NaN (0x7f, 0xff), which the AVX2 tiles then decode without the NaN test. */
#define FP8_FINITE 2

/* Weight rows and x rows one tile multiplies together (AVX2: see the top comment). */
#if VL == 16
#define R 4
#else
#define R 1
#endif
#define MT 4
/* Below this many multiply-adds a call runs on one thread. */
#define PARALLEL_MIN_WORK (1 << 18)

typedef uint32_t vu __attribute__((vector_size(4 * VL)));

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---- Element conversions ---- */


/* VL bytes at p widened to int32 lanes, sign- or zero-extended. x86 gets its widening
 * loads (GCC lowers __builtin_convertvector's byte-to-int lane by lane). */
static inline vi widen_bytes(const uint8_t *p, int is_signed) {
#if defined(__AVX512F__)
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    return (vi)(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    return (vi)(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
    vi out;
    for (int lane = 0; lane < VL; lane++) out[lane] = is_signed ? (int8_t)p[lane] : p[lane];
    return out;
#endif
}

static inline vi select_i(vi mask, vi a, vi b) { return (mask & a) | (~mask & b); }

/* fp8_to_f32 on VL codes. */
static inline vf fp8_to_f32_v(vi code) {
    const vi magnitude = code & 0x7f;
    const vf subnormal = __builtin_convertvector(magnitude, vf) * (1.0f / 512.0f);
    vi bits = select_i(magnitude < 8, (vi)subnormal, (magnitude << 20) + (120 << 23));
    bits = select_i(magnitude == 0x7f, (vi){0} + 0x7fc00000, bits);
    return (vf)(bits | ((code & 0x80) << 24));
}

/* A W8 code as float32; zero: the int8 code's zero point (0 for fp8 and symmetric int8). */
static inline float w8_code(const uint8_t *weight, int64_t k, int fp8, int32_t zero) {
    return fp8 ? fp8_to_f32(weight[k]) : (float)((int32_t)(int8_t)weight[k] - zero);
}

#if defined(__F16C__) && (defined(__AVX512F__) || defined(__AVX2__))
/* fp8_to_f32 on VL codes through float16, whose conversion instruction takes
 * subnormals whatever the flush-to-zero modes: the code sign-extended to 16 bits and
 * shifted left 7 keeps its sign in bit 15 and its exponent and mantissa in float16's
 * low exponent and high mantissa bits (bit 14, a copy of the sign, cleared): that
 * float16 is the fp8 value times 2^-8, subnormals included. The NaN codes come out as
 * +-1.875 (exponent 15 is normal in float16), which no other code gives. */
static inline vf fp8_codes(const uint8_t *p) {
#if defined(__AVX512F__)
    __m256i half = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    half = _mm256_and_si256(_mm256_slli_epi16(half, 7), _mm256_set1_epi16((short)0xbf80));
    const vf value = (vf)_mm512_cvtph_ps(half);
#else
    __m128i half = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    half = _mm_and_si128(_mm_slli_epi16(half, 7), _mm_set1_epi16((short)0xbf80));
    const vf value = (vf)_mm256_cvtph_ps(half);
#endif
    const vi is_nan = ((vi)value & 0x7fffffff) == 0x3ff00000;  /* 1.875 */
    return blend(is_nan, splat(__builtin_nanf("")), value * 256.0f);
}
#else
static inline vf fp8_codes(const uint8_t *p) { return fp8_to_f32_v(widen_bytes(p, 0)); }
#endif

static inline vf w8_codes(const uint8_t *weight, int64_t k, int fp8, int32_t zero) {
    if (fp8) return fp8_codes(weight + k);
    return __builtin_convertvector(widen_bytes(weight + k, 1) - zero, vf);
}

#if VL == 8 && defined(__AVX2__) && defined(__F16C__)
/* The AVX2 decode tiles take 2 VL codes a step (W8_PAIRS): fp8 codes are widened to
 * float16 for 16 at a time, and their factor 2^8 is left to the scale. */
#define W8_PAIRS 1
/* Weight rows ahead of the tile's that each step prefetches. */
#define AHEAD 4
/* 2 VL codes at p as float32 in two vectors (low: the first VL): int8 codes as they
 * are, fp8 codes times 2^-8 (fp8_codes without its last multiply; the NaN codes made
 * float16 NaNs by setting every bit, since 1.875 times a scale is no NaN, except for
 * fp8 == FP8_FINITE: a weight the launcher found free of NaN codes). */
typedef struct { vf low, high; } vf_pair;  /* returned by value: kept in registers */
static inline vf_pair w8_code_pair(const uint8_t *p, int fp8, int32_t zero) {
    vf_pair codes;
    if (!fp8) {  /* int8 codes less their zero point, in integers */
        const __m256i z = _mm256_set1_epi32(zero);
        codes.low = (vf)_mm256_cvtepi32_ps(
            _mm256_sub_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)), z));
        codes.high = (vf)_mm256_cvtepi32_ps(
            _mm256_sub_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))), z));
        return codes;
    }
    const __m256i shifted = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    __m256i half = _mm256_and_si256(shifted, _mm256_set1_epi16((short)0xbf80));
    if (fp8 != FP8_FINITE) {
        const __m256i nan_bits = _mm256_set1_epi16(0x3f80);  /* exponent and mantissa all ones */
        half = _mm256_or_si256(half, _mm256_cmpeq_epi16(_mm256_and_si256(shifted, nan_bits), nan_bits));
    }
    codes.low = (vf)_mm256_cvtph_ps(_mm256_castsi256_si128(half));
    codes.high = (vf)_mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
    return codes;
}
#else
#define W8_PAIRS 0
#endif

/* Weight rows one W8 tile multiplies together. The AVX2 pair tiles take two: each x
 * vector loaded then serves two rows' codes (one row's tiles were bound by the loads
 * of x), and their 8 sums, two multiply-adds a step each, keep the FMA units' 4-cycle
 * latency covered in 16 vector registers. */
#if W8_PAIRS
#define R8 2
#else
#define R8 R
#endif

static inline float load_x(const void *x, int64_t index, int kind) {
#ifdef __FLT16_MAX__
    if (kind == 2) return (float)((const _Float16 *)x)[index];
#endif
    return load1(x, index, kind == 1);
}

static inline void store_out(void *out, int64_t index, float value, int kind) {
    if (kind == 0) ((float *)out)[index] = value;
    else if (kind == 1) ((uint16_t *)out)[index] = f32_to_bf16(value);
#ifdef __FLT16_MAX__
    else ((_Float16 *)out)[index] = (_Float16)value;
#endif
}

/* VL float32 values stored at out[index ..] in the panel's dtype (kind as x's),
 * rounded to nearest even. Weights hold no NaN but fp8's, which stays NaN. */
static inline void store_panel(void *out, int64_t index, vf value, int kind) {
    if (kind == 0) {
        memcpy((float *)out + index, &value, sizeof value);
    } else if (kind == 1) {
#if defined(__AVX512BF16__) && VL == 16
        const __m256bh half = _mm512_cvtneps_pbh((__m512)value);
        memcpy((uint16_t *)out + index, &half, sizeof half);
#else
        const vu bits = (vu)value;
        const vh half = __builtin_convertvector((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, vh);
        memcpy((uint16_t *)out + index, &half, sizeof half);
#endif
    } else {
        for (int lane = 0; lane < VL; lane++) store_out(out, index + lane, value[lane], kind);
    }
}

/* ---- x into float32 scratch ---- */

/* x [M, K] (x_stride apart) -> xf [M, K] float32 contiguous. With group > 0 (W4),
 * each run of 2 VL columns of a group is reordered: its VL even columns, then its VL
 * odd ones; a group's last G % (2 VL) columns keep their order. */
static void prepare_x(const void *x, int64_t x_stride, int kind, float *xf, int64_t rows, int64_t K,
                      int64_t group) {
    for (int64_t m = 0; m < rows; m++) {
        const int64_t base = m * x_stride;
        float *xr = xf + m * K;
        for (int64_t k = 0; k < K; k++) xr[k] = load_x(x, base + k, kind);
        if (group <= 0) continue;
        const int64_t runs = group / (2 * VL);
        float run[2 * VL];
        for (int64_t g = 0; g < K; g += group) {
            for (int64_t c = 0; c < runs; c++) {
                float *start = xr + g + c * 2 * VL;
                for (int i = 0; i < VL; i++) {
                    run[i] = start[2 * i];
                    run[VL + i] = start[2 * i + 1];
                }
                memcpy(start, run, sizeof run);
            }
        }
    }
}

/* ---- Decode tiles: R weight rows times MT rows of x ---- */

/* result[r][m] = sum_k w8(n_r, k) * x[m][k]. scale_rows[r], zero_rows[r]: row n_r / bn of
 * scale and zero, the latter read only where ``asym`` (a constant in each instance: the
 * symmetric ones subtract a constant 0, which the compiler drops). Each block's vector
 * sums are reduced into float32 totals at its end, so no vector sum stays live across
 * blocks (registers for the tile's rows). */
static inline __attribute__((always_inline)) void w8_tile(
    const float *const x[MT], const uint8_t *const w[R8], const float *const scale_rows[R8],
    const int8_t *const zero_rows[R8], int64_t K, int64_t bk, int fp8, const int asym, const int mt,
    float result[R8][MT]) {
    float total[R8][MT];
    for (int r = 0; r < R8; r++)
        for (int m = 0; m < mt; m++) total[r][m] = 0.0f;
    for (int64_t k0 = 0, kb = 0; k0 < K; k0 += bk, kb++) {
        const int64_t k1 = min64(K, k0 + bk);
        float s[R8];
        int32_t z[R8];
        for (int r = 0; r < R8; r++) s[r] = scale_rows[r][kb], z[r] = asym ? zero_rows[r][kb] : 0;
        int64_t k = k0;
#if W8_PAIRS
        /* fp8 pairs come times 2^-8: the scale times 2^8 restores them exactly (one
         * rounding of code times scale, as w8_codes' product), where that stays finite. */
        int scaled = 1;
        float pair_scale[R8];
        for (int r = 0; r < R8; r++) {
            pair_scale[r] = fp8 ? s[r] * 256.0f : s[r];
            scaled &= __builtin_isfinite(pair_scale[r]);
        }
        if (scaled && k + 2 * VL <= k1) {  /* else the loop below, exact */
            /* The block's codes times x, summed unscaled, then times the scale once: one
             * multiply per block instead of one per VL codes (the FMA ports' spare slots
             * are what the AVX2 tiles run short of). */
            /* Up to 2 rows of x, the high halves' products go to sums of their own (each
             * sum's chain of multiply-adds is what bounds those tiles). */
            const int split = mt <= 2;
            vf block[R8][MT], high_block[R8][2];
            for (int r = 0; r < R8; r++)
                for (int m = 0; m < mt; m++) {
                    block[r][m] = splat(0.0f);
                    if (split) high_block[r][m] = splat(0.0f);
                }
            for (; k + 2 * VL <= k1; k += 2 * VL) {
                vf_pair codes[R8];
                for (int r = 0; r < R8; r++) {
                    __builtin_prefetch(w[r] + k + AHEAD * K);
                    codes[r] = w8_code_pair(w[r] + k, fp8, z[r]);
                }
#pragma GCC unroll 4
                for (int m = 0; m < mt; m++) {
                    const vf x_low = loadv(x[m], k, 0), x_high = loadv(x[m], k + VL, 0);
                    for (int r = 0; r < R8; r++) {
                        block[r][m] += codes[r].low * x_low;
                        if (split) high_block[r][m] += codes[r].high * x_high;
                        else block[r][m] += codes[r].high * x_high;
                    }
                }
            }
            for (int r = 0; r < R8; r++)
                for (int m = 0; m < mt; m++)
                    total[r][m] += hsum(split ? block[r][m] + high_block[r][m] : block[r][m]) * pair_scale[r];
        }
#endif
        if (k + VL <= k1) {
            vf part[R8][MT];
            for (int r = 0; r < R8; r++)
                for (int m = 0; m < mt; m++) part[r][m] = splat(0.0f);
            for (; k + VL <= k1; k += VL) {
                for (int r = 0; r < R8; r++) {
                    /* The next tile's rows follow these R8 in memory: a row is too short a
                     * stream (K bytes) for the hardware prefetcher to run ahead of. */
                    __builtin_prefetch(w[r] + k + R8 * K);
                    const vf wv = w8_codes(w[r], k, fp8, z[r]) * s[r];
                    /* x read where it is used: copied to an array first, GCC stages the
                     * copy through the stack in halves and each full-width read stalls. */
#pragma GCC unroll 4
                    for (int m = 0; m < mt; m++) part[r][m] += wv * loadv(x[m], k, 0);
                }
            }
            for (int r = 0; r < R8; r++)
                for (int m = 0; m < mt; m++) total[r][m] += hsum(part[r][m]);
        }
        for (; k < k1; k++)
            for (int r = 0; r < R8; r++) {
                const float wv = w8_code(w[r], k, fp8, z[r]) * s[r];
                for (int m = 0; m < mt; m++) total[r][m] += wv * x[m][k];
            }
    }
    for (int r = 0; r < R8; r++)
        for (int m = 0; m < mt; m++) result[r][m] = total[r][m];
}

#if VL == 8
/* The 8-lane builds' W4 tile (AVX2, and SSE in register pairs): each group's codes
 * times x are summed as they are (0 .. 15, converted exactly), then times the scale
 * once per group, and the zero point enters as zero * scale * (the group's sum of x)
 * (group_sums), so a step of 2 VL codes costs two converts besides its multiply-adds
 * instead of two subtractions and two multiplies more; the low and high nibbles'
 * products go to sums of their own (twice the chains in flight). Equal to the
 * per-code dequantization up to float32 rounding. */
#define W4_FOLD 1
/* Weight rows ahead of the tile's that each step prefetches. */
#define AHEAD_W4 1
static inline __attribute__((always_inline)) void w4_tile(
    const float *const x[MT], const float *const group_sums[MT], const uint8_t *const w[R],
    const float *const scale_rows[R], const float *const zero_rows[R], int64_t K, int64_t group, const int mt,
    float result[R][MT]) {
    vf acc[R][MT];
    float tail[R][MT], shift[R][MT];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) acc[r][m] = splat(0.0f), tail[r][m] = shift[r][m] = 0.0f;
    const int64_t vector_end = group / (2 * VL) * 2 * VL;
    for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, g++) {
        float s[R], z[R];
        for (int r = 0; r < R; r++) s[r] = scale_rows[r][g], z[r] = zero_rows[r] ? zero_rows[r][g] : 8.0f;
        if (vector_end) {
            vf low_sum[R][MT], high_sum[R][MT];
            for (int r = 0; r < R; r++)
                for (int m = 0; m < mt; m++) low_sum[r][m] = high_sum[r][m] = splat(0.0f);
            for (int64_t c = g0; c < g0 + vector_end; c += 2 * VL) {
                for (int r = 0; r < R; r++) {
                    __builtin_prefetch(w[r] + (c + AHEAD_W4 * K) / 2);
                    const vi codes = widen_bytes(w[r] + c / 2, 0);
                    const vf low = __builtin_convertvector(codes & 15, vf);
                    const vf high = __builtin_convertvector(codes >> 4, vf);
#pragma GCC unroll 4
                    for (int m = 0; m < mt; m++) {
                        low_sum[r][m] += low * loadv(x[m], c, 0);
                        high_sum[r][m] += high * loadv(x[m], c + VL, 0);
                    }
                }
            }
            for (int r = 0; r < R; r++)
                for (int m = 0; m < mt; m++) {
                    acc[r][m] += (low_sum[r][m] + high_sum[r][m]) * s[r];
                    shift[r][m] += z[r] * s[r] * group_sums[m][g];
                }
        }
        for (int64_t k = g0 + vector_end; k < g0 + group; k++)
            for (int r = 0; r < R; r++) {
                const uint8_t byte = w[r][k / 2];
                const float wv = ((float)((k & 1) ? byte >> 4 : byte & 15) - z[r]) * s[r];
                for (int m = 0; m < mt; m++) tail[r][m] += wv * x[m][k];
            }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) result[r][m] = (hsum(acc[r][m]) - shift[r][m]) + tail[r][m];
}
#else
#define W4_FOLD 0
/* result[r][m] = sum_k w4(n_r, k) * x[m][k], x reordered by prepare_x. */
static inline __attribute__((always_inline)) void w4_tile(
    const float *const x[MT], const float *const group_sums[MT], const uint8_t *const w[R],
    const float *const scale_rows[R], const float *const zero_rows[R], int64_t K, int64_t group, const int mt,
    float result[R][MT]) {
    (void)group_sums;
    vf acc[R][MT];
    float tail[R][MT];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) acc[r][m] = splat(0.0f), tail[r][m] = 0.0f;
    const int64_t vector_end = group / (2 * VL) * 2 * VL;
    for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, g++) {
        float s[R], z[R];
        for (int r = 0; r < R; r++) s[r] = scale_rows[r][g], z[r] = zero_rows[r] ? zero_rows[r][g] : 8.0f;
        for (int64_t c = g0; c < g0 + vector_end; c += 2 * VL) {
            for (int r = 0; r < R; r++) {
                __builtin_prefetch(w[r] + (c + R * K) / 2);
                const vi codes = widen_bytes(w[r] + c / 2, 0);
                const vf low = (__builtin_convertvector(codes & 15, vf) - z[r]) * s[r];
                const vf high = (__builtin_convertvector(codes >> 4, vf) - z[r]) * s[r];
#pragma GCC unroll 4
                for (int m = 0; m < mt; m++) acc[r][m] += low * loadv(x[m], c, 0) + high * loadv(x[m], c + VL, 0);
            }
        }
        for (int64_t k = g0 + vector_end; k < g0 + group; k++)
            for (int r = 0; r < R; r++) {
                const uint8_t byte = w[r][k / 2];
                const float wv = ((float)((k & 1) ? byte >> 4 : byte & 15) - z[r]) * s[r];
                for (int m = 0; m < mt; m++) tail[r][m] += wv * x[m][k];
            }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) result[r][m] = hsum(acc[r][m]) + tail[r][m];
}
#endif

/* Rows past N (or past M) repeat the last valid one; their results are not stored. */
static inline void tile_rows(const float *xf, int64_t m0, int64_t rows, int64_t K, const float *x_rows[MT]) {
    for (int m = 0; m < MT; m++) x_rows[m] = xf + min64(m0 + m, rows - 1) * K;
}

static inline void store_tile(const float result[][MT], int tile_rows, int64_t n0, int64_t m0, int64_t N,
                              int64_t rows, const float *bias, void *out, int64_t out_stride, int kind) {
    for (int r = 0; r < tile_rows && n0 + r < N; r++)
        for (int m = 0; m < MT && m0 + m < rows; m++)
            store_out(out, (m0 + m) * out_stride + n0 + r, result[r][m] + (bias ? bias[n0 + r] : 0.0f), kind);
}

static void w8_linear_rows(const float *xf, int64_t rows, const uint8_t *weight, int fp8, const float *scale,
                           const int8_t *zero, int64_t scale_cols, int64_t bn, int64_t bk, const float *bias,
                           void *out, int64_t out_stride, int kind, int64_t N, int64_t K, int num_threads) {
    /* The codes' kind, one tile instance each: int8, fp8, int8 less zero points, fp8
     * without NaN codes. */
    const int codes = fp8 == FP8_FINITE ? 3 : fp8 ? 1 : zero ? 2 : 0;
    const int64_t blocks = (N + R8 - 1) / R8;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * N * K >= PARALLEL_MIN_WORK)")
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * R8;
        const uint8_t *w[R8];
        const float *scale_rows[R8];
        const int8_t *zero_rows[R8];
        for (int r = 0; r < R8; r++) {
            const int64_t n = min64(n0 + r, N - 1);
            w[r] = weight + n * K;
            scale_rows[r] = scale + n / bn * scale_cols;
            zero_rows[r] = zero ? zero + n / bn * scale_cols : NULL;
        }
        for (int64_t m0 = 0; m0 < rows; m0 += MT) {
            const float *x_rows[MT];
            float result[R8][MT];
            tile_rows(xf, m0, rows, K, x_rows);
            /* One instance per (codes, rows of x): each keeps its accumulators in registers. */
#define W8_TILE(FP8, ASYM, ROWS) w8_tile(x_rows, w, scale_rows, zero_rows, K, bk, FP8, ASYM, ROWS, result)
            switch ((int)min64(rows - m0, MT) * 4 + codes) {
            case 4: W8_TILE(0, 0, 1); break;
            case 5: W8_TILE(1, 0, 1); break;
            case 6: W8_TILE(0, 1, 1); break;
            case 7: W8_TILE(FP8_FINITE, 0, 1); break;
            case 8: W8_TILE(0, 0, 2); break;
            case 9: W8_TILE(1, 0, 2); break;
            case 10: W8_TILE(0, 1, 2); break;
            case 11: W8_TILE(FP8_FINITE, 0, 2); break;
#if MT == 4
            case 12: W8_TILE(0, 0, 3); break;
            case 13: W8_TILE(1, 0, 3); break;
            case 14: W8_TILE(0, 1, 3); break;
            case 15: W8_TILE(FP8_FINITE, 0, 3); break;
            case 16: W8_TILE(0, 0, 4); break;
            case 17: W8_TILE(1, 0, 4); break;
            case 18: W8_TILE(0, 1, 4); break;
            case 19: W8_TILE(FP8_FINITE, 0, 4); break;
#endif
            }
#undef W8_TILE
            store_tile(result, R8, n0, m0, N, rows, bias, out, out_stride, kind);
        }
    }
}

void w8_linear(const void *x, int64_t x_stride, int kind, float *xf, int64_t rows, const uint8_t *weight,
               int fp8, const float *scale, const int8_t *zero, int64_t scale_cols, int64_t bn, int64_t bk,
               const float *bias, void *out, int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    prepare_x(x, x_stride, kind, xf, rows, K, 0);
    w8_linear_rows(xf, rows, weight, fp8, scale, zero, scale_cols, bn, bk, bias, out, out_stride, kind, N, K,
                   num_threads);
}

void w4_linear(const void *x, int64_t x_stride, int kind, float *xf, int64_t rows, const uint8_t *packed,
               const float *scales, const float *zeros, int64_t group, const float *bias, void *out,
               int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    prepare_x(x, x_stride, kind, xf, rows, K, group);
    const int64_t groups = K / group, blocks = (N + R - 1) / R;
    /* W4_FOLD: each row's sum of x over each group's whole runs of 2 VL columns, in the
     * scratch past x's float32 copy. */
    float *sums = W4_FOLD ? xf + rows * K : NULL;
    for (int64_t m = 0; sums && m < rows; m++)
        for (int64_t g = 0; g < groups; g++) {
            const float *start = xf + m * K + g * group;
            vf total = splat(0.0f);
            for (int64_t c = 0; c < group / (2 * VL) * 2 * VL; c += VL) total += loadv(start, c, 0);
            sums[m * groups + g] = hsum(total);
        }
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * N * K >= PARALLEL_MIN_WORK)")
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * R;
        const uint8_t *w[R];
        const float *scale_rows[R], *zero_rows[R];
        for (int r = 0; r < R; r++) {
            const int64_t n = min64(n0 + r, N - 1);
            w[r] = packed + n * (K / 2);
            scale_rows[r] = scales + n * groups;
            zero_rows[r] = zeros ? zeros + n * groups : NULL;
        }
        for (int64_t m0 = 0; m0 < rows; m0 += MT) {
            const float *x_rows[MT];
            float result[R][MT];
            const float *sum_rows[MT];
            tile_rows(xf, m0, rows, K, x_rows);
            for (int m = 0; m < MT; m++) sum_rows[m] = sums ? sums + min64(m0 + m, rows - 1) * groups : NULL;
#define W4_TILE(ROWS) w4_tile(x_rows, sum_rows, w, scale_rows, zero_rows, K, group, ROWS, result)
            switch ((int)min64(rows - m0, MT)) {
            case 1: W4_TILE(1); break;
            case 2: W4_TILE(2); break;
#if MT == 4
            case 3: W4_TILE(3); break;
            case 4: W4_TILE(4); break;
#endif
            }
#undef W4_TILE
            store_tile(result, R, n0, m0, N, rows, bias, out, out_stride, kind);
        }
    }
}

/* ---- Panels for the prefill shapes ---- */

/* zero_row: the row's zero points, read only where ``asym`` (see w8_tile). */
static inline __attribute__((always_inline)) void w8_dequantize_row(
    const uint8_t *w, const float *scale_row, const int8_t *zero_row, int64_t K, int64_t bk, int fp8,
    const int asym, void *panel, int64_t base, int kind) {
    for (int64_t k0 = 0, kb = 0; k0 < K; k0 += bk, kb++) {
        const int64_t k1 = min64(K, k0 + bk);
        const float s = scale_row[kb];
        const int32_t z = asym ? zero_row[kb] : 0;
        int64_t k = k0;
        for (; k + VL <= k1; k += VL) store_panel(panel, base + k, w8_codes(w, k, fp8, z) * s, kind);
        for (; k < k1; k++) store_out(panel, base + k, w8_code(w, k, fp8, z) * s, kind);
    }
}

void w8_dequantize(const uint8_t *weight, int fp8, const float *scale, const int8_t *zero, int64_t scale_cols,
                   int64_t bn, int64_t bk, int64_t n0, int64_t n1, int64_t K, void *panel, int kind,
                   int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t n = n0; n < n1; n++) {
        const float *scale_row = scale + n / bn * scale_cols;
        const uint8_t *w = weight + n * K;
        if (fp8) w8_dequantize_row(w, scale_row, NULL, K, bk, 1, 0, panel, (n - n0) * K, kind);
        else if (zero)
            w8_dequantize_row(w, scale_row, zero + n / bn * scale_cols, K, bk, 0, 1, panel, (n - n0) * K, kind);
        else w8_dequantize_row(w, scale_row, NULL, K, bk, 0, 0, panel, (n - n0) * K, kind);
    }
}

void w4_dequantize(const uint8_t *packed, const float *scales, const float *zeros, int64_t group, int64_t n0,
                   int64_t n1, int64_t K, void *panel, int kind, int num_threads) {
    const int64_t groups = K / group;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = packed + n * (K / 2);
        const int64_t base = (n - n0) * K;
        for (int64_t g = 0; g < groups; g++) {
            const float s = scales[n * groups + g], z = zeros ? zeros[n * groups + g] : 8.0f;
            int64_t k = g * group;
            for (; k + 2 * VL <= (g + 1) * group; k += 2 * VL) {
                const vi codes = widen_bytes(w + k / 2, 0);
                const vf low = (__builtin_convertvector(codes & 15, vf) - z) * s;
                const vf high = (__builtin_convertvector(codes >> 4, vf) - z) * s;
                store_panel(panel, base + k, SHUFFLE2(low, high, ZIP_LOW), kind);
                store_panel(panel, base + k + VL, SHUFFLE2(low, high, ZIP_HIGH), kind);
            }
            for (; k < (g + 1) * group; k++) {
                const uint8_t byte = w[k / 2];
                store_out(panel, base + k, ((float)((k & 1) ? byte >> 4 : byte & 15) - z) * s, kind);
            }
        }
    }
}

/* Whether this build stores float16 (the compiler knows _Float16). */
int quant_takes_float16(void) {
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}
