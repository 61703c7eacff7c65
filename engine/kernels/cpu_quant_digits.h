/* The decode tile of cpu_quant_bf16.c for int8 weights and one row of x on CPUs with
 * AVX512_VNNI: integer byte products (vpdpbusd, 64 per instruction) instead of the
 * bfloat16 dot product (32), and no widening of the codes at all. Part of
 * cpu_quant_bf16.c (included there; not a library of its own).
 *
 * x's rows in fixed point. Each row of x is scaled by a power of two, unit = 2^(e - 22)
 * with max|x| < 2^e, and rounded to integers q (|q| < 2^22), written as three signed
 * base-256 digits, q = d0 + 256 d1 + 65536 d2 (planes of int8, DIGITS of them). An
 * element whose exponent is within 14 of the row's largest is exactly q * unit (a
 * bfloat16 holds 8 significant bits); a smaller one is off by at most unit / 2, a
 * 2^-23 share of max|x|, below float32's own rounding of the largest products. The
 * integer sums are exact; each 32-bit lane's plane sums are combined in float32 once
 * per scale block, multiplied by the scale and, at the end, by unit: the result
 * equals the float32 reference up to float32 rounding.
 *
 * vpdpbusd multiplies unsigned bytes by signed ones: the digits are the signed side,
 * and the int8 codes are made unsigned by adding 128 (flipping the top bit), each lane
 * starting from -128 times its sum of digits over the block (digit_lanes), which the
 * products of the added 128 then cancel exactly.
 *
 * Layouts: digits [rows][DIGITS][Kp], Kp = K rounded up to 64, zero past K, in column
 * order. Taken where every scale block is whole chunks of 64 columns (or the whole
 * row), K <= 2^20 (int32 lanes cannot overflow), and every row of x finite with its
 * largest magnitude at least 2^-105 (else the callers keep the bfloat16 dot-product
 * tiles).
 */
#ifndef SHARDLINE_CPU_QUANT_DIGITS_H
#define SHARDLINE_CPU_QUANT_DIGITS_H

#if defined(__AVX512VNNI__)

#define DIGITS 3
#define DW 4               /* weight rows per tile */
#define DIGIT_ROWS 2       /* rows of x per tile: DW x DIGIT_ROWS x DIGITS accumulators, in registers */
#define DIGIT_MAX_K (1 << 20)

/* x's rows as digit planes, and what the tiles add back per block or group. */
typedef struct {
    int8_t *digits;        /* [rows][DIGITS][Kp] */
    int32_t *lanes;        /* [rows][blocks][DIGITS][16] -128 x each lane's digit sum */
    double unit[DMT];
    int64_t Kp, blocks, block;
} x_digits;

/* Row m's planes of q for columns k .. k + 15 (q: 16 int32), stored at out (plane p at
 * out + p * Kp) with lane i going to position[i] (16 positions, natural or run order). */
static inline void store_digits(__m512i q, int8_t *out, int64_t Kp) {
    for (int p = 0; p < DIGITS; p++) {
        _mm_storeu_si128((__m128i *)(out + p * Kp), _mm512_cvtepi32_epi8(q));  /* the low byte, signed */
        const __m512i digit = _mm512_srai_epi32(_mm512_slli_epi32(q, 24), 24);
        q = _mm512_srai_epi32(_mm512_sub_epi32(q, digit), 8);
    }
}

/* q of 16 bfloat16 at x (count of them; the rest 0), times factor, rounded to nearest. */
static inline __m512i row_q16(const uint16_t *x, int count, __m512 factor) {
    const __m256i bits = _mm256_maskz_loadu_epi16((__mmask16)((1u << count) - 1), x);
    const __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    return _mm512_cvtps_epi32(_mm512_mul_ps(value, factor));
}

/* max|x| over K bfloat16 (NaN where any is NaN: the comparison below fails then). */
static float row_max(const uint16_t *x, int64_t K) {
    __m512 max = _mm512_setzero_ps();
    int nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
        const int count = (int)min64(16, K - k);
        const __m256i bits = _mm256_maskz_loadu_epi16((__mmask16)((1u << count) - 1), x + k);
        const __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
        nan |= _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q) != 0;
        max = _mm512_max_ps(max, _mm512_abs_ps(value));
    }
    return nan ? __builtin_nanf("") : _mm512_reduce_max_ps(max);
}

/* Row m of x into its digit planes; 0 where the row cannot be. */
static int digits_row(const uint16_t *x, int64_t K, int8_t *out, int64_t Kp, double *unit) {
    const float max = row_max(x, K);
    if (!(max < __builtin_inff())) return 0;
    int e = 0;
    frexpf(max, &e);
    if (max == 0.0f) e = 0;
    if (e < -105) return 0;  /* 2^(22 - e) would not be a float */
    *unit = ldexp(1.0, e - 22);
    const __m512 factor = _mm512_set1_ps(ldexpf(1.0f, 22 - e));
    for (int64_t k = 0; k < K; k += 16) store_digits(row_q16(x + k, (int)min64(16, K - k), factor), out + k, Kp);
    return 1;
}

/* Per row and block: the lanes' -128 x digit sums. */
static void digit_block_sums(x_digits *xd, int64_t rows) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t m = 0; m < rows; m++)
        for (int64_t b = 0; b < xd->blocks; b++) {
            const int64_t k0 = b * xd->block, k1 = min64(xd->Kp, k0 + xd->block);
            for (int p = 0; p < DIGITS; p++) {
                const int8_t *plane = xd->digits + (m * DIGITS + p) * xd->Kp;
                __m512i lanes = _mm512_setzero_si512();
                for (int64_t k = k0; k < k1; k += 64)
                    lanes = _mm512_dpbusd_epi32(lanes, ones, _mm512_loadu_si512(plane + k));
                _mm512_storeu_si512(xd->lanes + ((m * xd->blocks + b) * DIGITS + p) * 16,
                                    _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(lanes, 7)));
            }
        }
}

/* x's digits for a call (block: the scale block's columns); 0 where the tiles do not
 * take it (the caller frees xd->digits either way). */
static int digits_prepare(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t K, int64_t block,
                          x_digits *xd) {
    xd->Kp = (K + 63) / 64 * 64, xd->block = block, xd->blocks = (K + block - 1) / block;
    const size_t planes = (size_t)(rows * DIGITS * xd->Kp);
    const size_t extra = (size_t)(rows * xd->blocks * DIGITS * 16) * sizeof(int32_t);
    xd->digits = aligned_alloc(64, planes + (extra + 63) / 64 * 64);
    if (!xd->digits) return 0;
    memset(xd->digits, 0, planes);
    xd->lanes = (int32_t *)(xd->digits + planes);
    for (int64_t m = 0; m < rows; m++)
        if (!digits_row(x + m * x_stride, K, xd->digits + m * DIGITS * xd->Kp, xd->Kp, &xd->unit[m])) return 0;
    digit_block_sums(xd, rows);
    return 1;
}

/* acc += the products of u's unsigned bytes and s's signed ones, 4 to a 32-bit lane. In
 * assembly so the accumulator stays in its register: GCC copies it in and out around
 * the intrinsic's instruction, which doubled the loop's instructions. */
#define DPBUSD(acc, u, s) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s))

/* The float32 sum of a lane's digit planes: d0 + 256 d1 + 65536 d2 (by value: an
 * array argument would keep the accumulators in memory through the loops). */
static inline __m512 combine_planes(__m512i d0, __m512i d1, __m512i d2) {
    const __m512 high = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d2), _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(d1));
    return _mm512_fmadd_ps(high, _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(d0));
}
#define COMBINE(acc) combine_planes((acc)[0], (acc)[1], (acc)[2])

/* Row m0 + m's digit planes from column k0. */
static inline void digit_planes(const x_digits *xd, int64_t m0, int mt, int64_t k0,
                                const int8_t *planes[DIGIT_ROWS][DIGITS]) {
    for (int m = 0; m < mt; m++)
        for (int p = 0; p < DIGITS; p++) planes[m][p] = xd->digits + ((m0 + m) * DIGITS + p) * xd->Kp + k0;
}

/* One chunk of 64 columns of the W8 tile: the DW rows' codes (LOAD, of w[r] + k) made
 * unsigned, times every digit plane of the tile's rows of x. */
#define W8_CHUNK(LOAD) do {                                                           \
        __m512i wv[DW];                                                               \
        for (int r = 0; r < DW; r++) wv[r] = _mm512_xor_si512(LOAD, flip);            \
        for (int m = 0; m < mt; m++)                                                  \
            for (int p = 0; p < DIGITS; p++) {                                        \
                const __m512i xv = _mm512_loadu_si512(planes[m][p] + k);              \
                for (int r = 0; r < DW; r++) DPBUSD(acc[r][m][p], wv[r], xv);         \
            }                                                                         \
    } while (0)

/* result[r][m] = sum_k w8(n_r, k) * x[m0 + m][k] / unit[m0 + m] for int8 codes; scale
 * blocks of xd->block columns (one block: the whole row, its scale applied at the end). */
static inline __attribute__((always_inline)) void w8_digit_tile(
    const x_digits *xd, int64_t m0, const uint8_t *const w[DW], const float *const scale_rows[DW], int64_t K,
    const int mt, float result[DW][DMT]) {
    __m512 sums[DW][DIGIT_ROWS];
    for (int r = 0; r < DW; r++)
        for (int m = 0; m < mt; m++) sums[r][m] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const uint8_t *next = w[0] + DW * K;
    for (int64_t b = 0; b < xd->blocks; b++) {
        const int64_t k0 = b * xd->block, k1 = min64(K, k0 + xd->block);
        __m512i acc[DW][DIGIT_ROWS][DIGITS];
        for (int m = 0; m < mt; m++)
            for (int p = 0; p < DIGITS; p++) {
                const __m512i start = _mm512_loadu_si512(xd->lanes + (((m0 + m) * xd->blocks + b) * DIGITS + p) * 16);
                for (int r = 0; r < DW; r++) acc[r][m][p] = start;
            }
        const int8_t *planes[DIGIT_ROWS][DIGITS];
        digit_planes(xd, m0, mt, 0, planes);
        int64_t k = k0;
        for (; k + 64 <= k1; k += 64) {  /* whole chunks: plain loads (a masked one costs a second uop) */
            for (int r = 0; r < DW; r++) __builtin_prefetch(next + DW * k + 64 * r);
            W8_CHUNK(_mm512_loadu_si512(w[r] + k));
        }
        if (k < k1) {
            const __mmask64 mask = (1ull << (k1 - k)) - 1;  /* no read past the row's end */
            W8_CHUNK(_mm512_maskz_loadu_epi8(mask, w[r] + k));
        }
        for (int r = 0; r < DW; r++)
            for (int m = 0; m < mt; m++)
                sums[r][m] = xd->blocks == 1 ? COMBINE(acc[r][m])
                                             : _mm512_fmadd_ps(COMBINE(acc[r][m]),
                                                               _mm512_set1_ps(scale_rows[r][b]), sums[r][m]);
    }
    for (int r = 0; r < DW; r++)
        for (int m = 0; m < mt; m++)
            result[r][m] = _mm512_reduce_add_ps(sums[r][m]) * (xd->blocks == 1 ? scale_rows[r][0] : 1.0f);
}

/* The result tile times each row of x's unit, plus the bias, rounded to bfloat16. */
static inline void store_digit_tile(float result[DW][DMT], int tile_rows, const double *unit, int64_t n0,
                                    int64_t m0, int mt, int64_t N, const float *bias, uint16_t *out,
                                    int64_t out_stride) {
    for (int r = 0; r < tile_rows && n0 + r < N; r++)
        for (int m = 0; m < mt; m++)
            out[(m0 + m) * out_stride + n0 + r] =
                f32_to_bf16(result[r][m] * (float)unit[m0 + m] + (bias ? bias[n0 + r] : 0.0f));
}

/* int8 weights through cpu_quant_digits.h's tiles; 0 (nothing written) where they do
 * not take the call: no AVX512_VNNI, blocks along K not whole chunks of 64, a row of x
 * they cannot scale. */
static int w8_digits_linear(const uint16_t *x, int64_t x_stride, int64_t rows, const uint8_t *weight,
                            const float *scale, int64_t scale_cols, int64_t bn, int64_t bk, const float *bias,
                            uint16_t *out, int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    const int64_t block = bk < K ? bk : K;
    x_digits xd = {0};
    if (rows > DMT || K > DIGIT_MAX_K || (block < K && block % 64) || !digits_prepare(x, x_stride, rows, K, block, &xd)) {
        free(xd.digits);
        return 0;
    }
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * N * K >= PARALLEL_MIN_WORK)")
    for (int64_t b = 0; b < (N + DW - 1) / DW; b++) {
        const uint8_t *w[DW];
        const float *scale_rows[DW];
        for (int r = 0; r < DW; r++) {
            const int64_t n = min64(b * DW + r, N - 1);  /* rows past N repeat the last; not stored */
            w[r] = weight + n * K;
            scale_rows[r] = scale + n / bn * scale_cols;
        }
        for (int64_t m0 = 0; m0 < rows; m0 += DIGIT_ROWS) {
            float result[DW][DMT];
            const int count = (int)min64(rows - m0, DIGIT_ROWS);
#define W8_DIGITS(ROWS) w8_digit_tile(&xd, m0, w, scale_rows, K, ROWS, result)
            if (count == 1) W8_DIGITS(1);
            else W8_DIGITS(2);
            store_digit_tile(result, DW, xd.unit, b * DW, m0, count, N, bias, out, out_stride);
        }
    }
    free(xd.digits);
    return 1;
}

#else

/* Without AVX512_VNNI the caller keeps the bfloat16 dot-product tiles. */
static int w8_digits_linear(const uint16_t *x, int64_t x_stride, int64_t rows, const uint8_t *weight,
                            const float *scale, int64_t scale_cols, int64_t bn, int64_t bk, const float *bias,
                            uint16_t *out, int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    (void)x, (void)x_stride, (void)rows, (void)weight, (void)scale, (void)scale_cols, (void)bn, (void)bk;
    (void)bias, (void)out, (void)out_stride, (void)N, (void)K, (void)num_threads;
    return 0;
}

#endif
#endif
