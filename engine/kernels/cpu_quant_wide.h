/* The wide decode tile of cpu_quant_bf16.c: W8 weights with one scale per weight row
 * (per channel or per tensor) times DECODE_MAX_ROWS + 1 .. WIDE_MAX_ROWS rows of
 * bfloat16 x (fp8: WIDE_FP8_MAX_ROWS). Part of cpu_quant_bf16.c (included there after
 * its decode tiles; not a library of its own).
 *
 * The register-blocked kernel (cpu_quant_blocked.h) decodes each weight once into a
 * panel transposed into the dot product's pair order and multiplies every row of x by
 * the panel; at these few rows its transposes and panel stores cost a large share of
 * the products. Here each weight row's codes are decoded 32 at a time in a register
 * and multiplied by every row of x at once (one accumulator per row of x, summing
 * along K as the decode tiles do): each code is decoded once and never transposed or
 * stored, and each weight row's lanes are summed once. x's rows (at most WIDE_MAX_K
 * columns, so they stay in L1 while every weight row passes over them) are copied
 * once per call WIDE_STRIDE apart: one base pointer and fixed offsets address them
 * all (sixteen row pointers would not fit the general registers). A group of
 * WIDE_GROUP weight rows' outputs is scaled and stored 16 columns a vector.
 *
 * Taken for K <= WIDE_MAX_K only: with K in chunks (x's rows in L1 a chunk at a time,
 * each weight row read a chunk at a time) the blocked kernel measured as fast or
 * faster in bench_quant_ab.py.
 *
 * Exactness as the decode tiles: every code is a bfloat16 value exactly and each
 * product of two bfloat16 values is exact in float32; the sums are float32, the
 * row's scale multiplies its sum once, one rounding to bfloat16 at the end.
 */
#ifndef SHARDLINE_CPU_QUANT_WIDE_H
#define SHARDLINE_CPU_QUANT_WIDE_H

#define WIDE_MAX_ROWS 16
/* fp8 codes are decoded by their byte tables (fp8_codes32), which hold registers of
 * their own: with 16 accumulators as well the loop ran slower than the blocked kernel. */
#define WIDE_FP8_MAX_ROWS 12
#define WIDE_MAX_K 1024  /* x's rows: WIDE_MAX_ROWS x WIDE_MAX_K x 2 bytes = 32 KiB, in L1 */
/* elements between the rows of x's copy: not a power of two, so the rows' lines at one
 * column fall in different L1 sets (2 KiB apart they share a few sets and evict each
 * other) */
#define WIDE_STRIDE (WIDE_MAX_K + 32)
#define WIDE_GROUP 16  /* weight rows per group: one vector of outputs per row of x */

/* sums[m * WIDE_GROUP] = sum over j < columns of w8(w[j]) * x[m * WIDE_STRIDE + j],
 * m < mt; the line of next (the row WIDE_ROWS_AHEAD ahead) prefetched as w's is read. */
#define WIDE_ROWS_AHEAD 2
static inline __attribute__((always_inline)) void w8_wide_row(
    const uint16_t *x, const uint8_t *w, const uint8_t *next, int64_t columns, int fp8,
    const fp8_tables *codes_table, const int mt, float *sums) {
    __m512 acc[WIDE_MAX_ROWS];
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= columns; k += 32) {
        if (!(k & 32)) __builtin_prefetch(next + k);  /* a 64-byte line every other step */
        const __m512bh wv = fp8 ? fp8_codes32(w + k, codes_table) : w8_codes_bf16(w + k, 0);
        for (int m = 0; m < mt; m++) acc[m] = _mm512_dpbf16_ps(acc[m], wv, load_x32(x + m * WIDE_STRIDE + k));
    }
    float lanes[WIDE_MAX_ROWS];
    lane_sums(acc, mt, lanes);
    for (int m = 0; m < mt; m++) {
        float tail = 0.0f;  /* the last columns % 32, in order */
        for (int64_t j = k; j < columns; j++) tail += w8_scalar(w[j], fp8) * bf16_to_f32(x[m * WIDE_STRIDE + j]);
        sums[m * WIDE_GROUP] = lanes[m] + tail;
    }
}

/* out[m][n] = bfloat16(sums[m][n - n0] * scale_n + bias_n) for the group's count rows. */
static void wide_store(const float sums[WIDE_MAX_ROWS][WIDE_GROUP], int64_t rows, int64_t n0, int64_t count,
                       const float *row_scales, const float *row_bias, uint16_t *out, int64_t out_stride) {
    const __m512 scales = _mm512_loadu_ps(row_scales), bias = _mm512_loadu_ps(row_bias);
    for (int64_t m = 0; m < rows; m++) {
        uint16_t *to = out + m * out_stride + n0;
        if (count == WIDE_GROUP) {
            storev(to, 0, (vf)_mm512_fmadd_ps(_mm512_loadu_ps(sums[m]), scales, bias), 1);
            continue;
        }
        for (int64_t r = 0; r < count; r++) to[r] = f32_to_bf16(sums[m][r] * row_scales[r] + row_bias[r]);
    }
}

/* w8_linear_bf16's product for DECODE_MAX_ROWS < rows <= WIDE_MAX_ROWS and K <=
 * WIDE_MAX_K where one scale covers whole weight rows (bk >= K): scale[(n / bn) *
 * scale_cols] scales row n. Returns 0 (nothing written) for fp8 codes past
 * WIDE_FP8_MAX_ROWS rows, or where x's copy cannot be allocated. */
static int w8_wide_linear(const uint16_t *x, int64_t x_stride, int64_t rows, const uint8_t *weight, int fp8,
                          const float *scale, int64_t scale_cols, int64_t bn, const float *bias, uint16_t *out,
                          int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    if (fp8 && rows > WIDE_FP8_MAX_ROWS) return 0;
    const int mt = rows <= 12 ? 12 : WIDE_MAX_ROWS;  /* the instances: rows past the last repeat it */
    uint16_t *copy = aligned_alloc(64, (size_t)(mt * WIDE_STRIDE) * sizeof(uint16_t));
    if (!copy) return 0;
    for (int m = 0; m < mt; m++)
        memcpy(copy + m * WIDE_STRIDE, x + min64(m, rows - 1) * x_stride, (size_t)K * sizeof(uint16_t));
    fp8_tables codes_table;  /* read by fp8 codes only */
    if (fp8) codes_table = fp8_byte_tables();
    const int64_t groups = (N + WIDE_GROUP - 1) / WIDE_GROUP;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * N * K >= PARALLEL_MIN_WORK)")
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = g * WIDE_GROUP, count = min64(WIDE_GROUP, N - n0);
        float sums[WIDE_MAX_ROWS][WIDE_GROUP] __attribute__((aligned(64)));
        float row_scales[WIDE_GROUP] = {0.0f}, row_bias[WIDE_GROUP] = {0.0f};
        for (int64_t r = 0; r < count; r++) {
            const int64_t n = n0 + r;
            const uint8_t *w = weight + n * K, *next = weight + min64(n + WIDE_ROWS_AHEAD, N - 1) * K;
            row_scales[r] = scale[(bn == 1 ? n : n / bn) * scale_cols];
            row_bias[r] = bias ? bias[n] : 0.0f;
#define WIDE_ROW(FP8, ROWS) w8_wide_row(copy, w, next, K, FP8, &codes_table, ROWS, &sums[0][r])
            if (fp8) WIDE_ROW(1, WIDE_FP8_MAX_ROWS);
            else if (mt == 12) WIDE_ROW(0, 12);
            else WIDE_ROW(0, WIDE_MAX_ROWS);
#undef WIDE_ROW
        }
        wide_store((const float (*)[WIDE_GROUP])sums, rows, n0, count, row_scales, row_bias, out, out_stride);
    }
    free(copy);
    return 1;
}

#endif
