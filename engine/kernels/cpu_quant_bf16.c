/* The quantized linears (cpu_quant.c) for bfloat16 x on CPUs with AVX512_BF16: the
 * decode shapes (up to the launcher's DECODE_MAX_ROWS rows of x, the decode tiles
 * below) and, in cpu_quant_blocked.h, up to its TILE_MAX_ROWS. The weight codes are
 * widened to bfloat16 and multiplied by x's bfloat16 values with the bfloat16
 * dot-product instruction (vdpbf16ps: pairs of products added into float32 lanes),
 * 32 weights per instruction where the float32 kernel takes 16.
 *
 * Exactness: every int8, fp8 and 4-bit code is a bfloat16 value exactly, and a product of two bfloat16 values
 * is exact in float32, so the sums are those of the float32 kernel up to their order.
 * The scales multiply the float32 sums of their block (W8) or group (W4) once. A
 * symmetric W4 weight's codes are taken as code - 8 (exact); a W4 zero point enters as
 * zero * scale * (the group's sum of x), so the codes stay exact whatever the zero (x's
 * group sums are float32).
 *
 * Built for every target; without AVX512_BF16 (and AVX512BW) quant_bf16_dot() is 0 and
 * the launcher keeps the float32 kernel. Layouts: as cpu_quant.c's, x bfloat16 only;
 * W4 groups a multiple of 32 (the launcher checks).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#include <immintrin.h>

#define PARALLEL_MIN_WORK (1 << 18)

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The float32 value of a W8 code, as cpu_quant.c decodes it (fp8: exact, NaN kept). */
static inline float w8_scalar(uint8_t code, int fp8) {
    return fp8 ? fp8_to_f32(code) : (float)(int8_t)code;
}

/* 32 W8 codes at p as bfloat16, in order (the decode tiles take fp8_codes32 for fp8).
 * fp8 by its bits: a normal code's exponent rebiased (7 -> 127) and mantissa moved up,
 * the 7 subnormals from a table, the NaN codes NaN, the sign bit moved up. */
static inline __m512bh w8_codes_bf16(const uint8_t *p, int fp8) {
    if (fp8) {
        const __m512i code = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
        const __m512i magnitude = _mm512_and_si512(code, _mm512_set1_epi16(0x7f));
        __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(120 << 7));
        const __m512i subnormals = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                    0, 0, 0, 0, 0, 0, 0, 0,
                                                    0x3c60, 0x3c40, 0x3c20, 0x3c00, 0x3bc0, 0x3b80, 0x3b00, 0);
        bits = _mm512_mask_mov_epi16(bits, _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8)),
                                     _mm512_permutexvar_epi16(magnitude, subnormals));
        bits = _mm512_mask_mov_epi16(bits, _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7f)),
                                     _mm512_set1_epi16(0x7fc0));
        bits = _mm512_ternarylogic_epi32(bits, _mm512_slli_epi16(code, 8), _mm512_set1_epi16((short)0x8000), 0xf8);
        return (__m512bh)bits;
    }
    __m512 low, high;
    low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(high, low);  /* lanes 0-15 from low, 16-31 from high */
}

/* 16 packed bytes (32 nibbles) as bfloat16 codes 0..15 in column order: each 32-bit lane
 * gets byte j's low nibble in its low half and its high nibble in its high half, and
 * the 16-bit halves index a table of bfloat16(0 .. 15). */
static inline __m512bh w4_codes_bf16(const uint8_t *p, __m512i table) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i pairs = _mm512_or_si512(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0f)),
                                          _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0xf0)), 12));
    return (__m512bh)_mm512_permutexvar_epi16(pairs, table);
}

/* A run of 64 columns' 32 packed bytes, each widened to a 16-bit lane (w4_run_bytes),
 * as two vectors of bfloat16 codes: the low nibbles (w4_run_even: columns 0, 2, .., 62
 * of the run) and the high ones (w4_run_odd: 1, 3, .., 63). A lane indexes the
 * 32-entry table (twice 0 .. 15) by its low 5 bits, so the low nibble needs no mask.
 * (Values, not pointers: GCC keeps arrays whose address is taken on the stack.) */
static inline __m512i w4_run_bytes(const uint8_t *p) {
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
}
static inline __m512bh w4_run_even(__m512i bytes, __m512i table) {
    return (__m512bh)_mm512_permutexvar_epi16(bytes, table);
}
static inline __m512bh w4_run_odd(__m512i bytes, __m512i table) {
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
}

/* x row [K] (K whole runs of 64) in w4_run_even / w4_run_odd's order: each run's even
 * columns, then its odd ones. */
static void w4_run_order(const uint16_t *x, int64_t K, uint16_t *out) {
    const __m512i evens = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                           30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_add_epi16(evens, _mm512_set1_epi16(1));
    for (int64_t k = 0; k < K; k += 64) {
        const __m512i low = _mm512_loadu_si512(x + k), high = _mm512_loadu_si512(x + k + 32);
        _mm512_storeu_si512(out + k, _mm512_permutex2var_epi16(low, evens, high));
        _mm512_storeu_si512(out + k + 32, _mm512_permutex2var_epi16(low, odds, high));
    }
}

static inline __m512bh load_x32(const uint16_t *x) { return (__m512bh)_mm512_loadu_si512(x); }

/* acc += the pairs' products of a and b (vdpbf16ps). In assembly so the accumulator
 * stays in its register: around the intrinsic GCC moved the operands through the
 * stack in the 4-bit runs' loop. */
#define DPBF16(acc, a, b) __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))

/* FP8 codes 64 at a time by table (the decode tiles' fast path): byte lookups of each
 * code's 7-bit magnitude give its bfloat16's high and low bytes (fp8_tables: 128 high
 * bytes, then 128 low ones, from w8_scalar: exact, NaN kept), the sign bit is or-ed in,
 * and the bytes interleave into two vectors of 32 bfloat16: *first holds columns
 * 16 L + 0..7 of each 128-bit lane L, *second 16 L + 8..15 (x_unpack_order's order). */
typedef struct { __m512i high[2], low[2]; } fp8_tables;

/* The tables of the bfloat16 bytes of magnitude(code) for the 128 7-bit codes. */
static fp8_tables byte_tables(float (*magnitude)(int code)) {
    uint8_t high[128], low[128];
    for (int code = 0; code < 128; code++) {
        const float value = magnitude(code);
        uint32_t bits;
        memcpy(&bits, &value, sizeof bits);
        high[code] = (uint8_t)(bits >> 24), low[code] = (uint8_t)(bits >> 16);
    }
    fp8_tables tables;
    for (int half = 0; half < 2; half++) {
        tables.high[half] = _mm512_loadu_si512(high + 64 * half);
        tables.low[half] = _mm512_loadu_si512(low + 64 * half);
    }
    return tables;
}

static float fp8_magnitude(int code) { return w8_scalar((uint8_t)code, 1); }

static fp8_tables fp8_byte_tables(void) { return byte_tables(fp8_magnitude); }

static inline void fp8_codes64(const uint8_t *p, const fp8_tables *tables, __m512bh *first, __m512bh *second) {
    const __m512i code = _mm512_loadu_si512(p);  /* permutex2var reads 7 index bits: the magnitude */
    __m512i high = _mm512_permutex2var_epi8(tables->high[0], code, tables->high[1]);
    const __m512i low = _mm512_permutex2var_epi8(tables->low[0], code, tables->low[1]);
    high = _mm512_ternarylogic_epi32(high, code, _mm512_set1_epi8((char)0x80), 0xf8);  /* | sign */
    *first = (__m512bh)_mm512_unpacklo_epi8(low, high);
    *second = (__m512bh)_mm512_unpackhi_epi8(low, high);
}

/* 32 fp8 codes at p as bfloat16, in order, by the byte tables: each code is copied to
 * both bytes of its 16-bit lane, the odd (high) bytes look up the bfloat16's high byte
 * and the even ones then its low byte, each lookup keeping the other bytes, and the
 * sign bit is or-ed in (the lookups read 7 index bits: the magnitude). */
static inline __m512bh fp8_codes32(const uint8_t *p, const fp8_tables *tables) {
    const __m512i pairs = _mm512_set_epi8(31, 31, 30, 30, 29, 29, 28, 28, 27, 27, 26, 26, 25, 25, 24, 24,
                                          23, 23, 22, 22, 21, 21, 20, 20, 19, 19, 18, 18, 17, 17, 16, 16,
                                          15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8,
                                          7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i code = _mm512_permutexvar_epi8(pairs, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)));
    const __m512i high = _mm512_mask2_permutex2var_epi8(tables->high[0], code, (__mmask64)0xAAAAAAAAAAAAAAAAull,
                                                        tables->high[1]);
    const __m512i bits = _mm512_mask2_permutex2var_epi8(tables->low[0], high, (__mmask64)0x5555555555555555ull,
                                                        tables->low[1]);
    return (__m512bh)_mm512_ternarylogic_epi32(bits, code, _mm512_set1_epi16((short)0x8000), 0xf8);
}

/* x row [K] into fp8_codes64's column order, each whole 64 columns: out[64 j + 8 L + i] =
 * x[64 j + 16 L + i], out[64 j + 32 + 8 L + i] = x[64 j + 16 L + 8 + i]; the last K % 64
 * columns as they are. */
static void x_unpack_order(const uint16_t *x, int64_t K, uint16_t *out) {
    int64_t k0 = 0;
    for (; k0 + 64 <= K; k0 += 64)
        for (int lane = 0; lane < 4; lane++) {
            memcpy(out + k0 + 8 * lane, x + k0 + 16 * lane, 8 * sizeof(uint16_t));
            memcpy(out + k0 + 32 + 8 * lane, x + k0 + 16 * lane + 8, 8 * sizeof(uint16_t));
        }
    memcpy(out + k0, x + k0, (size_t)(K - k0) * sizeof(uint16_t));
}

/* The sums of four vectors' lanes, [sum a, sum b, sum c, sum d]: the lanes added
 * pairwise in one tree across the four, a third of four horizontal reductions' work
 * (a tile's epilogue, once per DR weight rows). */
static inline __m128 sums4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps((__m512)_mm512_unpacklo_pd((__m512d)ab, (__m512d)cd),
                                      (__m512)_mm512_unpackhi_pd((__m512d)ab, (__m512d)cd));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                      (__m256)_mm512_extractf64x4_pd((__m512d)abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* sums[m] = the sum of acc[m]'s lanes, m < count. */
static inline __attribute__((always_inline)) void lane_sums(const __m512 *acc, int count, float *sums) {
    int m = 0;
    for (; m + 4 <= count; m += 4) _mm_storeu_ps(sums + m, sums4(acc[m], acc[m + 1], acc[m + 2], acc[m + 3]));
    for (; m < count; m++) sums[m] = _mm512_reduce_add_ps(acc[m]);
}

/* Prefetch the bytes [p, p + bytes) of the next tile's stretch, a cache line at a time. */
#define PREFETCH_SPAN(p, bytes) do {                                               \
        for (int line = 0; line < (bytes); line += 64) __builtin_prefetch((p) + line); \
    } while (0)

/* ---- Few rows of x (up to the launcher's DECODE_MAX_ROWS): DR weight rows a tile ----
 *
 * Each tile decodes DR = 4 adjacent weight rows, VL codes at a time, in registers and
 * multiplies them by up to DMT rows of x (DMT_BLOCKED where scales change along K,
 * which needs a second set of accumulators), so up to 8 rows of x share one decode.
 * Four rows give 4 rows of x sixteen independent accumulators, enough to cover the
 * dot product's latency (two rows' eight were not), and halve the tiles' epilogues
 * (the reductions, the tail, the stores) against two rows. The rows are one
 * contiguous stretch of the weight, and each step prefetches the stretch of the tile
 * PREFETCH_TILES ahead in order, as many bytes as the step reads (a short row is too
 * short a stream for the hardware prefetcher, and streams of several rows at once
 * measured slower; one tile ahead, the lines came too late once the tiles' decoding
 * got faster). */
#define DR 4
#define PREFETCH_TILES 2
#define DMT 8
#define DMT_BLOCKED 4

/* acc[r][m] += the products of codes [k0, k1) of weight row r and x row m, 32 codes a
 * step in order (k1 - k0 a multiple of 32), each step prefetching its share of the tile
 * PREFETCH_TILES ahead (next: that tile's start); fp8 codes by codes_table
 * (fp8_codes32). */
static inline __attribute__((always_inline)) void w8_products(
    const uint16_t *const x[DMT], const uint8_t *const w[DR], int64_t k0, int64_t k1, const uint8_t *next,
    int fp8, const fp8_tables *codes_table, const int mt, __m512 acc[DR][DMT]) {
    for (int64_t k = k0; k < k1; k += 32) {
        PREFETCH_SPAN(next + DR * k, DR * 32);
        __m512bh wv[DR];
        for (int r = 0; r < DR; r++) wv[r] = fp8 ? fp8_codes32(w[r] + k, codes_table) : w8_codes_bf16(w[r] + k, 0);
        for (int m = 0; m < mt; m++) {
            const __m512bh xv = load_x32(x[m] + k);
            for (int r = 0; r < DR; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
        }
    }
}

/* result[r][m] = sum_k w8(n_r, k) * x[m][k] with scales along K: scale_rows[r] is row
 * n_r / bn of scale, whose column kb scales the columns [kb bk, (kb + 1) bk). fp8 codes
 * are decoded by codes_table (fp8_codes32, in order), or 64 at a time in
 * x_unpack_order's order where tables is given (x reordered to match). */
static inline __attribute__((always_inline)) void w8_tile(
    const uint16_t *const x[DMT], const uint8_t *const w[DR], const float *const scale_rows[DR], int64_t K,
    int64_t bk, int fp8, const fp8_tables *tables, const fp8_tables *codes_table, const int mt,
    float result[DR][DMT]) {
    __m512 acc[DR][DMT];
    float tail[DR][DMT];
    for (int r = 0; r < DR; r++)
        for (int m = 0; m < mt; m++) acc[r][m] = _mm512_setzero_ps(), tail[r][m] = 0.0f;
    const uint8_t *next = w[0] + PREFETCH_TILES * DR * K;  /* past the weight's end: prefetches never fault */
    for (int64_t k0 = 0, kb = 0; k0 < K; k0 += bk, kb++) {
        const int64_t k1 = min64(K, k0 + bk);
        __m512 part[DR][DMT];
        for (int r = 0; r < DR; r++)
            for (int m = 0; m < mt; m++) part[r][m] = _mm512_setzero_ps();
        int64_t k = k0;
        for (; tables && k + 64 <= k1; k += 64) {  /* fp8 by table, x in x_unpack_order */
            PREFETCH_SPAN(next + DR * k, DR * 64);
            __m512bh first[DR], second[DR];
            for (int r = 0; r < DR; r++) fp8_codes64(w[r] + k, tables, &first[r], &second[r]);
            for (int m = 0; m < mt; m++) {
                const __m512bh x_first = load_x32(x[m] + k), x_second = load_x32(x[m] + k + 32);
                for (int r = 0; r < DR; r++) {
                    part[r][m] = _mm512_dpbf16_ps(part[r][m], first[r], x_first);
                    part[r][m] = _mm512_dpbf16_ps(part[r][m], second[r], x_second);
                }
            }
        }
        const int64_t whole = k + (k1 - k) / 32 * 32;
        w8_products(x, w, k, whole, next, fp8, codes_table, mt, part);
        k = whole;
        for (int r = 0; r < DR; r++) {
            const float s = scale_rows[r][kb];
            for (int64_t j = k; j < k1; j++) {
                const float wv = w8_scalar(w[r][j], fp8) * s;
                for (int m = 0; m < mt; m++) tail[r][m] += wv * bf16_to_f32(x[m][j]);
            }
            for (int m = 0; m < mt; m++) acc[r][m] = _mm512_fmadd_ps(part[r][m], _mm512_set1_ps(s), acc[r][m]);
        }
    }
    for (int r = 0; r < DR; r++) {
        float sums[DMT];
        lane_sums(acc[r], mt, sums);
        for (int m = 0; m < mt; m++) result[r][m] = sums[m] + tail[r][m];
    }
}

/* The 4 float32 lanes of v as bfloat16 bits, lane 0 lowest (cpu_common.h's bf16_bits_v). */
static inline uint64_t bf16x4_bits(__m128 v) {
    const vu bits = bf16_bits_v((vf)_mm512_zextps128_ps512(v)) >> 16;
    return (uint64_t)_mm_cvtsi128_si64(_mm256_castsi256_si128(_mm512_cvtepi32_epi16((__m512i)bits)));
}

/* w8_tile where one scale multiplies each weight row's sum (no blocks along K, codes in
 * order), finished in place: out[m][n0 + r] = scales[r] * sum_k w8(n0 + r, k) * x[m][k]
 * + bias4[r], for the first ``stored`` of the tile's DR rows. The accumulators stay in
 * registers from the first product to the stores, and each row of x's DR outputs is
 * summed in one tree, scaled, rounded and stored together, so the tile's epilogue
 * stays small next to its inner loop (w8_tile's, with sums per block along K and each
 * output finished alone, is a large share of a call at these few rows). */
static inline __attribute__((always_inline)) void w8_scaled_tile(
    const uint16_t *const x[DMT], const uint8_t *const w[DR], int64_t K, int fp8, const fp8_tables *codes_table,
    const int mt, __m128 scales, __m128 bias4, int stored, uint16_t *out, int64_t out_stride) {
    __m512 acc[DR][DMT];
    for (int r = 0; r < DR; r++)
        for (int m = 0; m < mt; m++) acc[r][m] = _mm512_setzero_ps();
    const int64_t k = K / 32 * 32;
    w8_products(x, w, 0, k, w[0] + PREFETCH_TILES * DR * K, fp8, codes_table, mt, acc);
    for (int m = 0; m < mt; m++) {
        __m128 sums = sums4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]);  /* [row 0, .., row 3] */
        if (k < K) {  /* the last K % 32 columns, in order */
            float tail[DR];
            for (int r = 0; r < DR; r++) {
                tail[r] = 0.0f;
                for (int64_t j = k; j < K; j++) tail[r] += w8_scalar(w[r][j], fp8) * bf16_to_f32(x[m][j]);
            }
            sums = _mm_add_ps(sums, _mm_loadu_ps(tail));
        }
        const uint64_t bits = bf16x4_bits(_mm_fmadd_ps(sums, scales, bias4));
        uint16_t *row = out + m * out_stride;
        if (stored == DR) memcpy(row, &bits, sizeof bits);
        else
            for (int r = 0; r < stored; r++) row[r] = (uint16_t)(bits >> (16 * r));
    }
}

/* result[r][m] = sum_k w4(n_r, k) * x[m][k]; x_sums[m][g]: x's sum over group g, NULL
 * for symmetric weights (the table's codes are code - 8, zero_rows unused). */
static inline __attribute__((always_inline)) void w4_tile(
    const uint16_t *const x[DMT], const float *const x_sums[DMT], const uint8_t *const w[DR],
    const float *const scale_rows[DR], const float *const zero_rows[DR], int64_t K, int64_t group,
    __m512i table, const int runs, const int mt, float result[DR][DMT]) {
    __m512 acc[DR][DMT];
    for (int r = 0; r < DR; r++)
        for (int m = 0; m < mt; m++) acc[r][m] = _mm512_setzero_ps();
    const uint8_t *next = w[0] + PREFETCH_TILES * DR * (K / 2);
    for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, g++) {
        __m512 part[DR][DMT];
        for (int r = 0; r < DR; r++)
            for (int m = 0; m < mt; m++) part[r][m] = _mm512_setzero_ps();
        if (runs) {  /* 64 codes a step, x in w4_run_order */
            for (int64_t k = g0; k < g0 + group; k += 64) {
                PREFETCH_SPAN(next + DR * k / 2, DR * 32);  /* DR rows of K / 2 bytes, 32 a step each */
                __m512bh even[DR], odd[DR];
                for (int r = 0; r < DR; r++) {
                    const __m512i bytes = w4_run_bytes(w[r] + k / 2);
                    even[r] = w4_run_even(bytes, table), odd[r] = w4_run_odd(bytes, table);
                }
                for (int m = 0; m < mt; m++) {
                    __m512bh x_even = load_x32(x[m] + k), x_odd = load_x32(x[m] + k + 32);
                    /* In registers once for the DR rows: GCC otherwise reloads them
                     * for every product, and those loads bound the loop (up to 4 rows
                     * of x: past them the registers are short and the reloads cheaper). */
                    if (mt <= 4) __asm__("" : "+v"(x_even), "+v"(x_odd));
                    for (int r = 0; r < DR; r++) {
                        DPBF16(part[r][m], even[r], x_even);
                        DPBF16(part[r][m], odd[r], x_odd);
                    }
                }
            }
        } else {
            for (int64_t k = g0; k < g0 + group; k += 32) {
                PREFETCH_SPAN(next + DR * k / 2, DR * 16);  /* DR rows of K / 2 bytes, 16 a step each */
                __m512bh wv[DR];
                for (int r = 0; r < DR; r++) wv[r] = w4_codes_bf16(w[r] + k / 2, table);
                for (int m = 0; m < mt; m++) {
                    const __m512bh xv = load_x32(x[m] + k);
                    for (int r = 0; r < DR; r++) part[r][m] = _mm512_dpbf16_ps(part[r][m], wv[r], xv);
                }
            }
        }
        for (int r = 0; r < DR; r++) {
            const __m512 s = _mm512_set1_ps(scale_rows[r][g]);
            for (int m = 0; m < mt; m++) acc[r][m] = _mm512_fmadd_ps(part[r][m], s, acc[r][m]);
        }
    }
    for (int r = 0; r < DR; r++) lane_sums(acc[r], mt, result[r]);
    /* The zero points' term after the products, so its sums hold no register through them;
     * none where the table already centres the codes (symmetric weights: x_sums NULL). */
    for (int r = 0; x_sums && r < DR; r++)
        for (int m = 0; m < mt; m++) {
            float shift = 0.0f;  /* sum over groups of zero * scale * the group's sum of x */
            for (int64_t g = 0; g < K / group; g++) shift += zero_rows[r][g] * scale_rows[r][g] * x_sums[m][g];
            result[r][m] -= shift;
        }
}

static inline void store_tile(float result[DR][DMT], int64_t n0, int64_t m0, int mt, int64_t N,
                              const float *bias, uint16_t *out, int64_t out_stride) {
    for (int r = 0; r < DR && n0 + r < N; r++)
        for (int m = 0; m < mt; m++)
            out[(m0 + m) * out_stride + n0 + r] = f32_to_bf16(result[r][m] + (bias ? bias[n0 + r] : 0.0f));
}

/* x_sums[m][g]: x row m's sum over W4 group g (float32): 32 columns a step in two
 * vectors (the even and the odd columns, each bfloat16 widened by its bits), then the
 * last group % 32 in order (one scalar chain of adds, each waiting for the last, was a
 * visible part of a 4-bit decode call). */
static void group_sums(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t group, int64_t K, float *x_sums) {
    const int64_t groups = K / group;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *column = x + m * x_stride + g * group;
            __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
            int64_t k = 0;
            for (; k + 32 <= group; k += 32) {
                const __m512i pairs = _mm512_loadu_si512(column + k);
                even = _mm512_add_ps(even, _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)));
                odd = _mm512_add_ps(odd, _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000))));
            }
            float sum = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
            for (; k < group; k++) sum += bf16_to_f32(column[k]);
            x_sums[m * groups + g] = sum;
        }
}

/* w4_codes_bf16's table: bfloat16(0 - offset .. 15 - offset), twice (exact for offsets 0 and 8). */
static __m512i w4_table(float offset) {
    float values[32];
    for (int i = 0; i < 32; i++) values[i] = (float)(i & 15) - offset;
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(values + 16), _mm512_loadu_ps(values));
}

/* One instance per (format, rows of x), so each keeps its accumulators in registers. */
#define BY_ROWS(CALL, count) do {                                                  \
        switch (count) {                                                           \
        case 1: CALL(1); break;                                                    \
        case 2: CALL(2); break;                                                    \
        case 3: CALL(3); break;                                                    \
        default: CALL(4); break;                                                   \
        }                                                                          \
    } while (0)
#define BY_ROWS8(CALL, count) do {                                                 \
        if ((count) <= 4) BY_ROWS(CALL, count);                                    \
        else if ((count) == 5) CALL(5);                                            \
        else if ((count) == 6) CALL(6);                                            \
        else if ((count) == 7) CALL(7);                                            \
        else CALL(8);                                                              \
    } while (0)

/* x_rows[m] = row m0 + m of x; rows past the last repeat it (their results are not stored). */
static inline void tile_x_rows(const uint16_t *x, int64_t x_stride, int64_t m0, int64_t rows,
                               const uint16_t *x_rows[DMT]) {
    for (int m = 0; m < DMT; m++) x_rows[m] = x + min64(m0 + m, rows - 1) * x_stride;
}

/* cpu_quant_amx.h's decode shapes (included with cpu_quant_blocked.h, below), taken
 * from these rows of x: with fewer, a decode shape reads the weight faster through
 * the byte-product tiles (int8), the 4-bit runs or the fp8 table path (one row), whose
 * cost grows with the rows where the tiles' decoding does not (bench_quant.py's
 * kernel mode on an AMX host). */
#define AMX_FP8_MIN_ROWS 2
#define AMX_INT8_MIN_ROWS 5
#define AMX_W4_MIN_ROWS 3
static int amx_w8_linear(const uint16_t *x, int64_t x_stride, int64_t rows, const uint8_t *weight, int fp8,
                         const float *scale, int64_t scale_cols, int64_t bn, int64_t bk, const float *bias,
                         uint16_t *out, int64_t out_stride, int64_t N, int64_t K, int num_threads);
static int amx_w4_linear(const uint16_t *x, int64_t x_stride, int64_t rows, float *x_sums, const uint8_t *packed,
                         const float *scales, const float *zeros, int64_t group, const float *bias, uint16_t *out,
                         int64_t out_stride, int64_t N, int64_t K, int num_threads);

/* int8 weights take cpu_quant_digits.h's byte products for this many rows of x, unless
 * the call's fp8 argument carries W8_NO_DIGITS: from two rows the bfloat16 tiles'
 * products, sharing one decode of the codes, read the weight faster than the digits'
 * three products per code and row (bench_quant.py's kernel mode). At one row which is
 * faster depends on the host: the engine races them (cpu/paths.py's quant_digits_kernel)
 * and each layer passes its choice. */
#define DIGITS_W8_MAX_ROWS 1
#define W8_NO_DIGITS 4

#include "cpu_quant_digits.h"  /* w8_digits_linear (AVX512_VNNI) */

/* Whether int8 weights' one-row decode shapes can take the digit products here. */
int quant_digits_ready(void) {
#if defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

int quant_bf16_dot(void) { return 1; }

void w8_blocked_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, const uint8_t *weight, int fp8,
                     const float *scale, int64_t scale_cols, int64_t bn, int64_t bk, const float *bias,
                     uint16_t *out, int64_t out_stride, int64_t N, int64_t K, int num_threads);

/* w8_linear_bf16 where one scale covers whole rows (bn rows, every column): the tiles
 * of w8_scaled_tile, up to DMT rows of x each. */
static void w8_scaled_linear(const uint16_t *x, int64_t x_stride, int64_t rows, const uint8_t *weight, int fp8,
                             const fp8_tables *codes_table, const float *scale, int64_t scale_cols, int64_t bn,
                             const float *bias, uint16_t *out, int64_t out_stride, int64_t N, int64_t K,
                             int num_threads) {
    const int64_t blocks = (N + DR - 1) / DR;
    for (int64_t m0 = 0; m0 < rows; m0 += DMT) {
        const uint16_t *x_rows[DMT];
        tile_x_rows(x, x_stride, m0, rows, x_rows);
        const int count = (int)min64(rows - m0, DMT);
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * N * K >= PARALLEL_MIN_WORK)")
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * DR;
            const uint8_t *w[DR];
            float row_scales[DR], row_bias[DR];
            for (int r = 0; r < DR; r++) {
                const int64_t n = min64(n0 + r, N - 1);  /* rows past N repeat the last; not stored */
                w[r] = weight + n * K;
                row_scales[r] = scale[(bn == 1 ? n : n / bn) * scale_cols];
                row_bias[r] = bias ? bias[n] : 0.0f;
            }
            const __m128 scales = _mm_loadu_ps(row_scales), bias4 = _mm_loadu_ps(row_bias);
            const int stored = (int)min64(DR, N - n0);
            uint16_t *tile_out = out + m0 * out_stride + n0;
#define INT8_SCALED(ROWS) w8_scaled_tile(x_rows, w, K, 0, NULL, ROWS, scales, bias4, stored, tile_out, out_stride)
#define FP8_SCALED(ROWS) w8_scaled_tile(x_rows, w, K, 1, codes_table, ROWS, scales, bias4, stored, tile_out, \
                                        out_stride)
            if (fp8) BY_ROWS8(FP8_SCALED, count);
            else BY_ROWS8(INT8_SCALED, count);
        }
    }
}

/* fp8: 1 for float8_e4m3fn codes, 0 for int8, plus W8_NO_DIGITS to keep one row of x
 * times int8 codes on the bfloat16 tiles. */
void w8_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, const uint8_t *weight, int fp8,
                    const float *scale, int64_t scale_cols, int64_t bn, int64_t bk, const float *bias,
                    uint16_t *out, int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    const int digits = !(fp8 & W8_NO_DIGITS);
    fp8 &= 1;
    if (rows >= (fp8 ? AMX_FP8_MIN_ROWS : AMX_INT8_MIN_ROWS) &&
        amx_w8_linear(x, x_stride, rows, weight, fp8, scale, scale_cols, bn, bk, bias, out, out_stride, N, K,
                      num_threads))
        return;
    if (!fp8 && digits && rows <= DIGITS_W8_MAX_ROWS &&
        w8_digits_linear(x, x_stride, rows, weight, scale, scale_cols, bn, bk, bias, out, out_stride, N, K,
                         num_threads))
        return;
    fp8_tables table_values;  /* read by fp8 codes only */
    if (fp8) table_values = fp8_byte_tables();
    if (bk >= K) {
        w8_scaled_linear(x, x_stride, rows, weight, fp8, &table_values, scale, scale_cols, bn, bias, out, out_stride,
                         N, K, num_threads);
        return;
    }
    const int64_t blocks = (N + DR - 1) / DR;
    if (rows > DMT_BLOCKED) {
        /* Past one tile of rows with blocks along K, these tiles would decode the
         * weight once per DMT_BLOCKED rows: the register-blocked kernel decodes it once
         * (measured faster there in bench_quant.py's kernel mode; W4 groups are not). */
        w8_blocked_bf16(x, x_stride, rows, weight, fp8, scale, scale_cols, bn, bk, bias, out, out_stride, N, K,
                        num_threads);
        return;
    }
    /* fp8 blocks by table for one row of x, where every block holds whole 64-column
     * runs (x reordered to match): with more rows the products, not the decoding, bound
     * the tile, and the table lookups measured slower than the conversions there, as
     * they did for one row of per-channel scales, whose tiles stream the weight from
     * memory without the blocks' pauses (bench_quant.py's kernel mode). */
    const fp8_tables *tables = fp8 && rows == 1 && bk % 64 == 0 ? &table_values : NULL;
    uint16_t *ordered = tables ? malloc((size_t)(rows * K) * sizeof(uint16_t)) : NULL;
    if (tables && !ordered) tables = NULL;
    for (int64_t m = 0; ordered && m < rows; m++) x_unpack_order(x + m * x_stride, K, ordered + m * K);
    if (ordered) x = ordered, x_stride = K;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * N * K >= PARALLEL_MIN_WORK)")
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * DR;
        const uint8_t *w[DR];
        const float *scale_rows[DR];
        for (int r = 0; r < DR; r++) {
            const int64_t n = min64(n0 + r, N - 1);  /* rows past N repeat the last; not stored */
            w[r] = weight + n * K;
            scale_rows[r] = scale + n / bn * scale_cols;
        }
        for (int64_t m0 = 0; m0 < rows; m0 += DMT_BLOCKED) {
            const uint16_t *x_rows[DMT];
            float result[DR][DMT];
            const int count = (int)min64(rows - m0, DMT_BLOCKED);
            tile_x_rows(x, x_stride, m0, rows, x_rows);
#define INT8_BLOCKED(ROWS) w8_tile(x_rows, w, scale_rows, K, bk, 0, NULL, NULL, ROWS, result)
#define FP8_BLOCKED(ROWS) w8_tile(x_rows, w, scale_rows, K, bk, 1, tables, &table_values, ROWS, result)
            if (fp8) BY_ROWS(FP8_BLOCKED, count);
            else BY_ROWS(INT8_BLOCKED, count);
            store_tile(result, n0, m0, count, N, bias, out, out_stride);
        }
    }
    free(ordered);
}

/* x_sums: [rows, K / group] float32 scratch. */
void w4_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, float *x_sums, const uint8_t *packed,
                    const float *scales, const float *zeros, int64_t group, const float *bias, uint16_t *out,
                    int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    if (rows >= AMX_W4_MIN_ROWS && amx_w4_linear(x, x_stride, rows, x_sums, packed, scales, zeros, group, bias, out,
                                                 out_stride, N, K, num_threads))
        return;
    const int64_t groups = K / group, blocks = (N + DR - 1) / DR;
    /* Symmetric weights (zero 8) take code - 8 from the table, so no zero term. */
    if (zeros) group_sums(x, x_stride, rows, group, K, x_sums);
    const __m512i table = w4_table(zeros ? 0.0f : 8.0f);
    /* Groups of whole runs of 64: the codes 64 at a time (w4_run_bytes), x reordered to match. */
    uint16_t *ordered = group % 64 == 0 ? malloc((size_t)(rows * K) * sizeof(uint16_t)) : NULL;
    for (int64_t m = 0; ordered && m < rows; m++) w4_run_order(x + m * x_stride, K, ordered + m * K);
    if (ordered) x = ordered, x_stride = K;
    const int runs = ordered != NULL;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * N * K >= PARALLEL_MIN_WORK)")
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * DR;
        const uint8_t *w[DR];
        const float *scale_rows[DR], *zero_rows[DR];
        for (int r = 0; r < DR; r++) {
            const int64_t n = min64(n0 + r, N - 1);
            w[r] = packed + n * (K / 2);
            scale_rows[r] = scales + n * groups;
            zero_rows[r] = zeros ? zeros + n * groups : NULL;
        }
        for (int64_t m0 = 0; m0 < rows; m0 += DMT_BLOCKED) {
            const uint16_t *x_rows[DMT];
            const float *sum_rows[DMT];
            float result[DR][DMT];
            const int count = (int)min64(rows - m0, DMT_BLOCKED);
            tile_x_rows(x, x_stride, m0, rows, x_rows);
            for (int m = 0; m < DMT; m++) sum_rows[m] = x_sums + min64(m0 + m, rows - 1) * groups;
#define W4_TILE(ROWS) w4_tile(x_rows, zeros ? sum_rows : NULL, w, scale_rows, zero_rows, K, group, table, 0, ROWS, result)
#define W4_RUNS(ROWS) w4_tile(x_rows, zeros ? sum_rows : NULL, w, scale_rows, zero_rows, K, group, table, 1, ROWS, result)
            if (runs) BY_ROWS(W4_RUNS, count);
            else BY_ROWS(W4_TILE, count);
            store_tile(result, n0, m0, count, N, bias, out, out_stride);
        }
    }
    free(ordered);
}

#include "cpu_quant_wide.h"     /* w8_wide_linear */
#include "cpu_quant_blocked.h"  /* w8_blocked_bf16, w4_blocked_bf16 */

#else

/* Without AVX512_BF16 the launcher keeps cpu_quant.c's float32 kernel. */
int quant_bf16_dot(void) { return 0; }

#endif
