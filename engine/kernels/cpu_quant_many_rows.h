/* The many-rows quantized kernel for bfloat16 x on AVX512_BF16 builds, part of
 * cpu_quant_bf16.c (included there after its decoders; not a library of its own). */
#ifndef SHARDLINE_CPU_QUANT_MANY_ROWS_H
#define SHARDLINE_CPU_QUANT_MANY_ROWS_H

#define R 4  /* weight rows per tile */

/* ---- Many rows of x (the launcher's TILE_MAX_ROWS): R weight rows decoded once ----
 *
 * Past a few rows of x, decoding the weight for every tile of MT rows costs more than
 * the products. Here each thread decodes R weight rows at a time into a tile of their
 * bfloat16 codes (exact, zero past K; R * K * 2 bytes, which stay in cache), then
 * multiplies the tile by every row of x, MANY_MT_WHOLE or MANY_MT_BLOCKED rows at a
 * time, with the accumulators in registers. Scales (and W4 zero points) apply to each block's float32 sums as in the
 * kernels above, so the results are theirs up to the order of the sums. */

/* A quantized weight as the tiles read it: W8 (format 0 int8, 1 fp8) codes [N, K] with
 * scale [ceil(N / bn), scale_cols] per bn x bk block; W4 (format 2) packed [N, K / 2]
 * with scale and zeros (NULL: 8) [N, K / bk], bn = 1, bk the group. */
typedef struct {
    const uint8_t *data;
    int format;
    const float *scale, *zeros;
    int64_t scale_cols, bn, bk;
} quant_weight;

#define MANY_MT_WHOLE 5    /* x rows per tile where one scale covers a weight row's K */
#define MANY_MT_BLOCKED 3  /* where blocks end inside K: a second set of accumulators */

/* tile[r][0 .. padded): weight row min(n0 + r, N - 1)'s codes as bfloat16, zero past K.
 * The next tile's rows are prefetched meanwhile: they arrive while this one multiplies. */
static void decode_tile(const quant_weight *weight, int64_t n0, int64_t N, int64_t K, int64_t padded,
                        __m512i table, uint16_t *tile) {
    for (int r = 0; r < R; r++) {
        const int64_t n = min64(n0 + r, N - 1);
        uint16_t *row = tile + r * padded;
        if (weight->format == 2) {  /* K is a multiple of 32 (groups of 32) */
            const uint8_t *packed = weight->data + n * (K / 2);
            for (int64_t k = 0; k < K; k += 32) {
                if (n + R < N) __builtin_prefetch(packed + R * (K / 2) + k / 2);
                _mm512_storeu_si512(row + k, (__m512i)w4_codes_bf16(packed + k / 2, table));
            }
            continue;
        }
        const uint8_t *codes = weight->data + n * K;
        const int fp8 = weight->format;
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            if (n + R < N) __builtin_prefetch(codes + R * K + k);
            _mm512_storeu_si512(row + k, (__m512i)w8_codes_bf16(codes + k, fp8));
        }
        if (k < K) {  /* the last codes through a zeroed copy: no read past the weight */
            uint8_t last[32] = {0};
            memcpy(last, codes + k, (size_t)(K - k));
            const __m512i decoded = (__m512i)w8_codes_bf16(last, fp8);
            _mm512_storeu_si512(row + k, _mm512_maskz_mov_epi16((__mmask32)((1ull << (K - k)) - 1), decoded));
        }
    }
}

/* part[r][m] = sum over k0 <= k < k1 of tile[r][k] * x[m][k] (float32 lanes). */
static inline __attribute__((always_inline)) void block_products(
    const uint16_t *tile, int64_t padded, const uint16_t *const x[MANY_MT_WHOLE], int64_t k0, int64_t k1,
    const int mt, __m512 part[R][MANY_MT_WHOLE]) {
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) part[r][m] = _mm512_setzero_ps();
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
        __m512bh xv[MANY_MT_WHOLE];
        for (int m = 0; m < mt; m++) xv[m] = load_x32(x[m] + k);
        for (int r = 0; r < R; r++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(tile + r * padded + k);
            for (int m = 0; m < mt; m++) part[r][m] = _mm512_dpbf16_ps(part[r][m], wv, xv[m]);
        }
    }
    if (k < k1) {  /* masked loads: nothing read past x's row, the next block's codes left out */
        const __mmask32 mask = (__mmask32)((1ull << (k1 - k)) - 1);
        __m512bh xv[MANY_MT_WHOLE];
        for (int m = 0; m < mt; m++) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[m] + k);
        for (int r = 0; r < R; r++) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, tile + r * padded + k);
            for (int m = 0; m < mt; m++) part[r][m] = _mm512_dpbf16_ps(part[r][m], wv, xv[m]);
        }
    }
}

/* result[r][m] = weight row n0 + r times x[m]; x_sums[m]: x's sums per W4 group. */
static inline __attribute__((always_inline)) void many_tile(
    const quant_weight *weight, const uint16_t *tile, int64_t padded, const uint16_t *const x[MANY_MT_WHOLE],
    const float *const x_sums[MANY_MT_WHOLE], int64_t n0, int64_t N, int64_t K, const int blocked, const int mt,
    float result[R][MANY_MT_WHOLE]) {
    const float *scale_rows[R], *zero_rows[R];
    for (int r = 0; r < R; r++) {
        const int64_t n = min64(n0 + r, N - 1);
        scale_rows[r] = weight->scale + n / weight->bn * weight->scale_cols;
        zero_rows[r] = weight->zeros ? weight->zeros + n * weight->scale_cols : NULL;
    }
    __m512 part[R][MANY_MT_WHOLE];
    if (!blocked) {
        block_products(tile, padded, x, 0, K, mt, part);
        for (int r = 0; r < R; r++)
            for (int m = 0; m < mt; m++) result[r][m] = _mm512_reduce_add_ps(part[r][m]) * scale_rows[r][0];
        return;
    }
    __m512 acc[R][MANY_MT_WHOLE];
    float shift[R][MANY_MT_WHOLE];  /* W4: sum over groups of zero * scale * the group's sum of x */
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) acc[r][m] = _mm512_setzero_ps(), shift[r][m] = 0.0f;
    for (int64_t k0 = 0, kb = 0; k0 < K; k0 += weight->bk, kb++) {
        block_products(tile, padded, x, k0, min64(K, k0 + weight->bk), mt, part);
        for (int r = 0; r < R; r++) {
            const float s = scale_rows[r][kb];
            for (int m = 0; m < mt; m++) acc[r][m] = _mm512_fmadd_ps(part[r][m], _mm512_set1_ps(s), acc[r][m]);
            if (weight->format == 2 && weight->zeros) {  /* symmetric: the tile holds code - 8 */
                const float zs = zero_rows[r][kb] * s;
                for (int m = 0; m < mt; m++) shift[r][m] += zs * x_sums[m][kb];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) result[r][m] = _mm512_reduce_add_ps(acc[r][m]) - shift[r][m];
}

static void many_rows(const quant_weight *weight, const uint16_t *x, int64_t x_stride, int64_t rows,
                      const float *x_sums, const float *bias, uint16_t *out, int64_t out_stride, int64_t N,
                      int64_t K, int num_threads) {
    const int64_t blocks = (N + R - 1) / R, padded = (K + 31) / 32 * 32;
    const int blocked = weight->format == 2 || weight->bk < K;
    const int64_t mt = blocked ? MANY_MT_BLOCKED : MANY_MT_WHOLE;
    const __m512i table = w4_table(weight->zeros ? 0.0f : 8.0f);
    _Pragma("omp parallel num_threads(num_threads)")
    {
        uint16_t *tile = aligned_alloc(64, (size_t)(R * padded) * sizeof(uint16_t));
        _Pragma("omp for schedule(static)")
        for (int64_t b = 0; b < blocks; b++) {
            decode_tile(weight, b * R, N, K, padded, table, tile);
            for (int64_t m0 = 0; m0 < rows; m0 += mt) {
                const uint16_t *x_rows[MANY_MT_WHOLE];
                const float *sum_rows[MANY_MT_WHOLE];
                float result[R][MANY_MT_WHOLE];
                for (int m = 0; m < MANY_MT_WHOLE; m++) {
                    const int64_t row = min64(m0 + m, rows - 1);
                    x_rows[m] = x + row * x_stride;
                    sum_rows[m] = x_sums ? x_sums + row * weight->scale_cols : NULL;
                }
#define WHOLE(ROWS) many_tile(weight, tile, padded, x_rows, sum_rows, b * R, N, K, 0, ROWS, result)
#define BLOCKED(ROWS) many_tile(weight, tile, padded, x_rows, sum_rows, b * R, N, K, 1, ROWS, result)
                const int count = (int)min64(rows - m0, mt);
                if (blocked) BY_ROWS(BLOCKED, count);
                else if (count == 5) WHOLE(5);
                else BY_ROWS(WHOLE, count);
#undef WHOLE
#undef BLOCKED
                for (int r = 0; r < R && b * R + r < N; r++)
                    for (int m = 0; m < count; m++)
                        out[(m0 + m) * out_stride + b * R + r] =
                            f32_to_bf16(result[r][m] + (bias ? bias[b * R + r] : 0.0f));
            }
        }
        free(tile);
    }
}

void w8_many_rows_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, const uint8_t *weight, int fp8,
                       const float *scale, int64_t scale_cols, int64_t bn, int64_t bk, const float *bias,
                       uint16_t *out, int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    const quant_weight w = {weight, fp8, scale, NULL, scale_cols, bn, bk};
    many_rows(&w, x, x_stride, rows, NULL, bias, out, out_stride, N, K, num_threads);
}

/* x_sums: [rows, K / group] float32 scratch. */
void w4_many_rows_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, float *x_sums, const uint8_t *packed,
                       const float *scales, const float *zeros, int64_t group, const float *bias, uint16_t *out,
                       int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    group_sums(x, x_stride, rows, group, K, x_sums);
    const quant_weight w = {packed, 2, scales, zeros, K / group, 1, group};
    many_rows(&w, x, x_stride, rows, x_sums, bias, out, out_stride, N, K, num_threads);
}

#endif
