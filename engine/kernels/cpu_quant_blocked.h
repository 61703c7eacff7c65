/* The register-blocked quantized kernel for bfloat16 x on AVX512_BF16 builds (the
 * launcher's rows past DECODE_MAX_ROWS up to its TILE_MAX_ROWS), part of
 * cpu_quant_bf16.c (included there after its decoders; not a library of its own).
 *
 * Past a few rows of x, decoding the codes costs more than the products when each
 * tile of x rows decodes them again. Here each thread takes NB = 16 NV output columns
 * at a time and, chunk by chunk of at most KC columns (never across a scale block),
 * decodes those weight rows once into a panel of bfloat16 codes in the dot-product
 * instruction's pair order (panel[p][n] = codes of columns 2p, 2p + 1 of row n: the
 * decoded rows transposed 16 x 16 in 32-bit units), which stays in the L1/L2 cache
 * while every row of x multiplies it: MB rows of x x NV vectors of 16 outputs in
 * registers, each step broadcasting a pair of x's columns against NV panel vectors.
 * No sum is reduced across lanes: lane n of an accumulator is output column n.
 *
 * Exactness as the decode tiles: every code is a bfloat16 value exactly and each
 * product of two bfloat16 values is exact in float32; a chunk's float32 sums are
 * multiplied by their block's scales (per output column) and added into a float32
 * scratch of the NB outputs of every row of x, so scales and the W4 zero term
 * (zero * scale * the group's sum of x, the panel holding code or code - 8) apply to
 * sums, never to codes. Results equal the float32 reference up to the order of sums.
 */
#ifndef SHARDLINE_CPU_QUANT_BLOCKED_H
#define SHARDLINE_CPU_QUANT_BLOCKED_H

#define NV 4           /* vectors of 16 output columns per tile */
#define NB (16 * NV)   /* output columns per panel */
#define MB 6           /* rows of x per tile: MB x NV accumulators, NV weights, a broadcast */
#define KC 256         /* columns per panel chunk (the panel: KC x NB x 2 bytes) */

/* A quantized weight as the panels read it: W8 (format 0 int8, 1 fp8) codes [N, K] with
 * scale [ceil(N / bn), scale_cols] per bn x bk block; W4 (format 2) packed [N, K / 2]
 * with scale and zeros (NULL: 8) [N, K / bk], bn = 1, bk the group (a multiple of 32). */
typedef struct {
    const uint8_t *data;
    int format;
    const float *scale, *zeros;
    int64_t scale_cols, bn, bk;
} quant_weight;

/* rows[i] lane j <-> rows[j] lane i, 32-bit lanes. */
static inline void transpose16(__m512i rows[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* Each 128-bit lane L of rows[4 a + b] now holds row group (4 a .. 4 a + 3)'s
     * column b + 4 L; interleave the 128-bit lanes of groups a across vectors. */
    for (int b = 0; b < 4; b++) {
        const __m512i r0 = rows[b], r1 = rows[4 + b], r2 = rows[8 + b], r3 = rows[12 + b];
        const __m512i s0 = _mm512_shuffle_i32x4(r0, r1, 0x44), s1 = _mm512_shuffle_i32x4(r0, r1, 0xee);
        const __m512i s2 = _mm512_shuffle_i32x4(r2, r3, 0x44), s3 = _mm512_shuffle_i32x4(r2, r3, 0xee);
        t[b] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        t[4 + b] = _mm512_shuffle_i32x4(s0, s2, 0xdd);
        t[8 + b] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        t[12 + b] = _mm512_shuffle_i32x4(s1, s3, 0xdd);
    }
    for (int i = 0; i < 16; i++) rows[i] = t[i];
}

/* Up to 32 codes of weight row n from column k (count of them; the rest zero) as bfloat16. */
static inline __m512i decode32(const quant_weight *weight, int64_t n, int64_t K, int64_t k, int64_t count,
                               __m512i table) {
    if (weight->format == 2)  /* whole groups of 32: count is 32 */
        return (__m512i)w4_codes_bf16(weight->data + n * (K / 2) + k / 2, table);
    const uint8_t *codes = weight->data + n * K + k;
    if (count >= 32) return (__m512i)w8_codes_bf16(codes, weight->format);
    uint8_t last[32] = {0};  /* no read past the weight */
    memcpy(last, codes, (size_t)count);
    const __m512i decoded = (__m512i)w8_codes_bf16(last, weight->format);
    return _mm512_maskz_mov_epi16((__mmask32)((1ull << count) - 1), decoded);
}

/* 16 whole rows' 32 codes from codes (rows row_bytes apart; W4: packed bytes) as
 * bfloat16, the rows the same stretch ahead prefetched. One instance per format. */
static inline __attribute__((always_inline)) void decode16(const uint8_t *codes, int64_t row_bytes,
                                                           int64_t ahead, const int format, __m512i table,
                                                           __m512i rows[16]) {
    for (int i = 0; i < 16; i++) {
        const uint8_t *row = codes + i * row_bytes;
        __builtin_prefetch(row + ahead);
        rows[i] = format == 2 ? (__m512i)w4_codes_bf16(row, table) : (__m512i)w8_codes_bf16(row, format);
    }
}

/* panel[p * NB + n] (32-bit pairs) = codes of columns k0 + 2p, k0 + 2p + 1 of weight
 * row n0 + n, for the chunk's (k1 - k0 + 1) / 2 pairs; zero past N and past k1. */
static void decode_panel(const quant_weight *weight, int64_t n0, int64_t N, int64_t K, int64_t k0, int64_t k1,
                         __m512i table, uint32_t *panel) {
    const int64_t pairs = (k1 - k0 + 1) / 2;
    const int w4 = weight->format == 2;
    const int64_t row_bytes = w4 ? K / 2 : K;
    /* The next chunk's codes of these rows (after the last chunk, the next panel's
     * first) are fetched while this chunk multiplies: NB rows read in short runs are
     * too many streams for the hardware prefetcher. */
    const int64_t ahead = k1 < K ? (w4 ? (k1 - k0) / 2 : k1 - k0) : NB * row_bytes - (w4 ? k0 / 2 : k0);
    for (int v = 0; v < NV; v++)
        for (int64_t c = 0; c < k1 - k0; c += 32) {
            __m512i rows[16];
            const int64_t n = n0 + 16 * v;
            const uint8_t *codes = weight->data + n * row_bytes + (w4 ? (k0 + c) / 2 : k0 + c);
            if (n + 16 <= N && c + 32 <= k1 - k0 && (n + 16 + NB <= N || k1 < K)) {
                if (weight->format == 0) decode16(codes, row_bytes, ahead, 0, table, rows);
                else if (weight->format == 1) decode16(codes, row_bytes, ahead, 1, table, rows);
                else decode16(codes, row_bytes, ahead, 2, table, rows);
            } else {
                for (int i = 0; i < 16; i++)
                    rows[i] = n + i < N ? decode32(weight, n + i, K, k0 + c, min64(32, k1 - k0 - c), table)
                                        : _mm512_setzero_si512();
            }
            transpose16(rows);
            for (int64_t j = 0; j < 16 && c / 2 + j < pairs; j++)
                _mm512_store_si512(panel + (c / 2 + j) * NB + 16 * v, rows[j]);
        }
}

/* acc[m][v] += panel[p][16 v ..] . b[m] (the 32-bit pair b[m] broadcast). */
static inline __attribute__((always_inline)) void pair_products(const uint32_t *panel, const uint32_t b[MB],
                                                                const int mb, __m512 acc[MB][NV]) {
    __m512bh w[NV];
    for (int v = 0; v < NV; v++) w[v] = (__m512bh)_mm512_load_si512(panel + 16 * v);
    for (int m = 0; m < mb; m++) {
        const __m512bh x_pair = (__m512bh)_mm512_set1_epi32((int)b[m]);
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], w[v], x_pair);
    }
}

/* acc[m][v] = sum over the chunk's pairs p of panel[p][16 v ..] . (x[m][2p], x[m][2p + 1]),
 * x[m] at the chunk's first column; an odd last column pairs with a zero. */
static inline __attribute__((always_inline)) void tile_products(const uint32_t *panel, int64_t columns,
                                                                const uint16_t *const x[MB], const int mb,
                                                                __m512 acc[MB][NV]) {
    for (int m = 0; m < mb; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    const int64_t pairs = columns / 2;
    uint32_t b[MB];
    for (int64_t p = 0; p < pairs; p++) {
        for (int m = 0; m < mb; m++) memcpy(&b[m], x[m] + 2 * p, sizeof b[m]);
        pair_products(panel + p * NB, b, mb, acc);
    }
    if (columns & 1) {  /* the odd last column, its partner zero */
        for (int m = 0; m < mb; m++) b[m] = x[m][2 * pairs];
        pair_products(panel + pairs * NB, b, mb, acc);
    }
}

/* sums[m][n] += acc[m][n] * scale[n] - zero_scale[n] * x_sum[m] (zero_scale NULL: no zero term). */
static inline __attribute__((always_inline)) void add_tile(__m512 acc[MB][NV], const int mb, const float *scale,
                                                           const float *zero_scale, const float *x_sum,
                                                           float *sums) {
    for (int m = 0; m < mb; m++)
        for (int v = 0; v < NV; v++) {
            float *to = sums + m * NB + 16 * v;
            __m512 total = _mm512_fmadd_ps(acc[m][v], _mm512_loadu_ps(scale + 16 * v), _mm512_load_ps(to));
            if (zero_scale)
                total = _mm512_fnmadd_ps(_mm512_loadu_ps(zero_scale + 16 * v), _mm512_set1_ps(x_sum[m]), total);
            _mm512_store_ps(to, total);
        }
}

#include "cpu_quant_amx.h"  /* amx_chunk_rows: the same products through AMX tiles */

/* The chunk's products for every row of x, MB rows at a time, added into sums [rows, NB]. */
static void chunk_rows(const uint32_t *panel, int64_t k0, int64_t k1, const uint16_t *x, int64_t x_stride,
                       int64_t rows, const float *scale, const float *zero_scale, const float *x_sums,
                       int64_t sums_stride, float *sums) {
    if (amx_chunk_rows(panel, k0, k1, x, x_stride, rows, scale, zero_scale, x_sums, sums_stride, sums)) return;
    for (int64_t m0 = 0; m0 < rows; m0 += MB) {
        const uint16_t *x_rows[MB];
        float x_sum[MB];
        for (int m = 0; m < MB; m++) {
            const int64_t row = min64(m0 + m, rows - 1);  /* past the last: not added */
            x_rows[m] = x + row * x_stride + k0;
            x_sum[m] = zero_scale ? x_sums[row * sums_stride] : 0.0f;
        }
        __m512 acc[MB][NV];
        float *to = sums + m0 * NB;
#define ROWS_OF(COUNT) do { tile_products(panel, k1 - k0, x_rows, COUNT, acc);            \
                            add_tile(acc, COUNT, scale, zero_scale, x_sum, to); } while (0)
        switch ((int)min64(rows - m0, MB)) {
        case 1: ROWS_OF(1); break;
        case 2: ROWS_OF(2); break;
        case 3: ROWS_OF(3); break;
        case 4: ROWS_OF(4); break;
        case 5: ROWS_OF(5); break;
        default: ROWS_OF(6); break;
        }
#undef ROWS_OF
    }
}

/* scale[n], zero_scale[n] (zero * scale; W4 with zeros only) of the NB columns from n0 for K-block kb. */
static void block_scales(const quant_weight *weight, int64_t n0, int64_t N, int64_t kb, float *scale,
                         float *zero_scale) {
    for (int n = 0; n < NB; n++) {
        const int64_t row = min64(n0 + n, N - 1);
        scale[n] = weight->scale[row / weight->bn * weight->scale_cols + kb];
        if (zero_scale) zero_scale[n] = weight->zeros[row * weight->scale_cols + kb] * scale[n];
    }
}

/* out[m][n0 ..] = bfloat16(sums + bias), 16 columns a vector: each output's rounding
 * weighs against only K / 32 products, so a scalar loop is a visible share of a call. */
static void store_outputs(const float *sums, int64_t rows, int64_t n0, int64_t N, const float *bias,
                          uint16_t *out, int64_t out_stride) {
    const int64_t columns = min64(NB, N - n0), whole = columns / 16 * 16;
    for (int64_t m = 0; m < rows; m++) {
        const float *row = sums + m * NB;
        uint16_t *to = out + m * out_stride + n0;
        for (int64_t j = 0; j < whole; j += 16) {
            const __m512 total = _mm512_add_ps(_mm512_load_ps(row + j),
                                               bias ? _mm512_loadu_ps(bias + n0 + j) : _mm512_setzero_ps());
            storev(to, j, (vf)total, 1);
        }
        for (int64_t j = whole; j < columns; j++) to[j] = f32_to_bf16(row[j] + (bias ? bias[n0 + j] : 0.0f));
    }
}

/* One panel of NB output columns over all of K, for every row of x. */
static void panel_columns(const quant_weight *weight, int64_t n0, const uint16_t *x, int64_t x_stride,
                          int64_t rows, const float *x_sums, const float *bias, uint16_t *out,
                          int64_t out_stride, int64_t N, int64_t K, __m512i table, uint32_t *panel,
                          float *sums) {
    float scale[NB], zero_scale[NB];
    float *zeros_used = weight->format == 2 && weight->zeros ? zero_scale : NULL;
    memset(sums, 0, (size_t)(rows * NB) * sizeof(float));
    for (int64_t b0 = 0, kb = 0; b0 < K; b0 += weight->bk, kb++) {
        block_scales(weight, n0, N, kb, scale, zeros_used);
        const int64_t b1 = min64(K, b0 + weight->bk);
        for (int64_t k0 = b0; k0 < b1; k0 += KC) {
            const int64_t k1 = min64(b1, k0 + KC);
            decode_panel(weight, n0, N, K, k0, k1, table, panel);
            /* the zero term once per block: only its first chunk carries it */
            chunk_rows(panel, k0, k1, x, x_stride, rows, scale, k0 == b0 ? zeros_used : NULL,
                       x_sums ? x_sums + kb : NULL, weight->scale_cols, sums);
        }
    }
    store_outputs(sums, rows, n0, N, bias, out, out_stride);
}

static void blocked_rows(const quant_weight *weight, const uint16_t *x, int64_t x_stride, int64_t rows,
                         const float *x_sums, const float *bias, uint16_t *out, int64_t out_stride, int64_t N,
                         int64_t K, int num_threads) {
    const int64_t panels = (N + NB - 1) / NB;
    const __m512i table = w4_table(weight->zeros ? 0.0f : 8.0f);
    _Pragma("omp parallel num_threads(num_threads)")
    {
        uint32_t *panel = aligned_alloc(64, (size_t)(KC / 2 * NB) * sizeof(uint32_t));
        float *sums = aligned_alloc(64, (size_t)((rows + MB) * NB) * sizeof(float));
        _Pragma("omp for schedule(static)")
        for (int64_t b = 0; b < panels; b++)
            panel_columns(weight, b * NB, x, x_stride, rows, x_sums, bias, out, out_stride, N, K, table, panel,
                          sums);
        free(sums);
        free(panel);
    }
}

void w8_blocked_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, const uint8_t *weight, int fp8,
                     const float *scale, int64_t scale_cols, int64_t bn, int64_t bk, const float *bias,
                     uint16_t *out, int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    if (amx_w8_linear(x, x_stride, rows, weight, fp8, scale, scale_cols, bn, bk, bias, out, out_stride, N, K,
                      num_threads))
        return;  /* up to 16 rows: the weight rows as AMX tiles, no panel transposed */
    if (rows <= WIDE_MAX_ROWS && K <= WIDE_MAX_K && bk >= K &&  /* one scale per weight row: no panel */
        w8_wide_linear(x, x_stride, rows, weight, fp8, scale, scale_cols, bn, bias, out, out_stride, N, K,
                       num_threads))
        return;
    const quant_weight w = {weight, fp8, scale, NULL, scale_cols, bn, min64(bk, K)};
    blocked_rows(&w, x, x_stride, rows, NULL, bias, out, out_stride, N, K, num_threads);
}

/* x_sums: [rows, K / group] float32 scratch. */
void w4_blocked_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, float *x_sums, const uint8_t *packed,
                     const float *scales, const float *zeros, int64_t group, const float *bias, uint16_t *out,
                     int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    if (amx_w4_linear(x, x_stride, rows, x_sums, packed, scales, zeros, group, bias, out, out_stride, N, K,
                      num_threads))
        return;
    if (zeros) group_sums(x, x_stride, rows, group, K, x_sums);
    const quant_weight w = {packed, 2, scales, zeros, K / group, 1, group};
    blocked_rows(&w, x, x_stride, rows, zeros ? x_sums : NULL, bias, out, out_stride, N, K, num_threads);
}

#endif
