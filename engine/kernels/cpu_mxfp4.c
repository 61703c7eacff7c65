/* MXFP4 weights on the CPU (gpt-oss's experts): kernels/quant_reference.py's layout,
 * blocks [N, K / 32, 16] uint8 (two E2M1 codes a byte, the lower index in the low
 * nibble) and scales [N, K / 32] uint8 (E8M0: 2^(s - 127)), of one expert.
 *
 *   mxfp4_matmul: out[m, n] = sum_k x[m, k] w[n, k]. Each group of 32 weights is
 *     decoded in registers: the sixteen E2M1 values times the group's power of two
 *     form a table, each nibble picks its lane (exact: an E2M1 value times a power of
 *     two is a float32). The low nibbles meet x's even columns and the high nibbles
 *     its odd ones, so x comes split into those two halves. The threads split the
 *     output rows; each weight row is decoded once per ROWS_PER_PASS rows of x.
 *   mxfp4_dequantize: the float32 rows [r0, r1) of w (prefill multiplies them with
 *     torch's matmul, a panel at a time).
 * ``exponents`` [256] float32 holds 2^(s - 127) for every scale byte s (the caller's
 * table, the reference's values). */
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));

/* Rows of x one pass over the weight serves: their accumulators stay in registers. */
#define ROWS_PER_PASS 8
/* Below this many weights a call runs on one thread (a team costs more than it saves). */
#define PARALLEL_MIN_WEIGHTS (1 << 16)

static const v16f FP4_E2M1 = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline v16i load_codes(const uint8_t *bytes) {
    v16u8 packed;
    memcpy(&packed, bytes, sizeof packed);
    return __builtin_convertvector(packed, v16i);
}

static inline v16f load_v16f(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum_lanes(v16f v) {
    float total = 0.0f;
    for (int j = 0; j < 16; j++) total += v[j];
    return total;
}

/* x_even, x_odd: [m_rows, K / 2] float32, row stride K / 2; out: float32, row stride out_stride. */
void mxfp4_matmul(const float *x_even, const float *x_odd, int64_t m_rows, const uint8_t *blocks,
                  const uint8_t *scales, const float *exponents, float *out, int64_t out_stride, int64_t n_rows,
                  int64_t groups, int num_threads) {
    const int64_t half = groups * 16;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (n_rows * groups * 32 >= PARALLEL_MIN_WEIGHTS)")
    for (int64_t n = 0; n < n_rows; n++) {
        const uint8_t *row_blocks = blocks + n * groups * 16;
        const uint8_t *row_scales = scales + n * groups;
        for (int64_t m0 = 0; m0 < m_rows; m0 += ROWS_PER_PASS) {
            const int64_t pass_rows = m_rows - m0 < ROWS_PER_PASS ? m_rows - m0 : ROWS_PER_PASS;
            const float *even = x_even + m0 * half, *odd = x_odd + m0 * half;
            v16f acc[ROWS_PER_PASS];
            for (int64_t m = 0; m < pass_rows; m++) acc[m] = (v16f){0};
            for (int64_t g = 0; g < groups; g++) {
                const v16f table = FP4_E2M1 * exponents[row_scales[g]];
                const v16i codes = load_codes(row_blocks + g * 16);
                const v16f low = __builtin_shuffle(table, codes & 15);
                const v16f high = __builtin_shuffle(table, codes >> 4);
                for (int64_t m = 0; m < pass_rows; m++) {
                    acc[m] += load_v16f(even + m * half + g * 16) * low + load_v16f(odd + m * half + g * 16) * high;
                }
            }
            for (int64_t m = 0; m < pass_rows; m++) out[(m0 + m) * out_stride + n] = sum_lanes(acc[m]);
        }
    }
}

/* out: [r1 - r0, K] float32, contiguous. */
void mxfp4_dequantize(const uint8_t *blocks, const uint8_t *scales, const float *exponents, float *out,
                      int64_t r0, int64_t r1, int64_t groups, int num_threads) {
    const v16i first = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const v16i second = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if ((r1 - r0) * groups * 32 >= PARALLEL_MIN_WEIGHTS)")
    for (int64_t r = r0; r < r1; r++) {
        float *row_out = out + (r - r0) * groups * 32;
        for (int64_t g = 0; g < groups; g++) {
            const v16f table = FP4_E2M1 * exponents[scales[r * groups + g]];
            const v16i codes = load_codes(blocks + (r * groups + g) * 16);
            const v16f low = __builtin_shuffle(table, codes & 15);
            const v16f high = __builtin_shuffle(table, codes >> 4);
            const v16f lower = __builtin_shuffle(low, high, first);
            const v16f upper = __builtin_shuffle(low, high, second);
            memcpy(row_out + g * 32, &lower, sizeof lower);
            memcpy(row_out + g * 32 + 16, &upper, sizeof upper);
        }
    }
}
