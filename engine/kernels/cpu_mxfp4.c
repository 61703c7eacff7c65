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
 *   mxfp4_dequantize: the rows [r0, r1) of w in float32 or bfloat16 (prefill multiplies
 *     them with torch's matmul, a panel at a time).
 * ``exponents`` [256] float32 holds 2^(s - 127) for every scale byte s (the caller's
 * table, the reference's values). */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));

/* Rows of x one pass over the weight serves: their accumulators stay in registers. */
#define ROWS_PER_PASS 8
/* Below this many weights a call runs on one thread (a team costs more than it saves). */
#define PARALLEL_MIN_WEIGHTS (1 << 16)

static const v16f FP4_E2M1 = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Sixteen bytes widened to int32 lanes: one instruction with AVX-512 (two with AVX2);
 * GCC's generic conversion extracts them one by one. */
static inline v16i load_codes(const uint8_t *bytes) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
#elif defined(__AVX2__)
    const __m128i packed = _mm_loadu_si128((const __m128i *)bytes);
    const __m256i low = _mm256_cvtepu8_epi32(packed), high = _mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8));
    v16i codes;
    memcpy(&codes, &low, sizeof low);
    memcpy((char *)&codes + sizeof low, &high, sizeof high);
    return codes;
#else
    v16u8 packed;
    memcpy(&packed, bytes, sizeof packed);
    return __builtin_convertvector(packed, v16i);
#endif
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

/* One weight row n against ``rows`` rows of x (a constant where it is inlined, so the
 * accumulators stay in registers). */
static inline __attribute__((always_inline)) void row_pass(
        const int rows, const float *even, const float *odd, int64_t half, const uint8_t *row_blocks,
        const uint8_t *row_scales, const float *exponents, int64_t groups, float *out, int64_t out_stride) {
    v16f acc[ROWS_PER_PASS];
    for (int m = 0; m < rows; m++) acc[m] = (v16f){0};
    for (int64_t g = 0; g < groups; g++) {
        const v16f table = FP4_E2M1 * exponents[row_scales[g]];
        const v16i codes = load_codes(row_blocks + g * 16);
        const v16f low = __builtin_shuffle(table, codes & 15);
        const v16f high = __builtin_shuffle(table, codes >> 4);
        for (int m = 0; m < rows; m++) {
            acc[m] += load_v16f(even + m * half + g * 16) * low + load_v16f(odd + m * half + g * 16) * high;
        }
    }
    for (int m = 0; m < rows; m++) out[m * out_stride] = sum_lanes(acc[m]);
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
            const int64_t rows = m_rows - m0 < ROWS_PER_PASS ? m_rows - m0 : ROWS_PER_PASS;
            const float *even = x_even + m0 * half, *odd = x_odd + m0 * half;
            float *row_out = out + m0 * out_stride + n;
            switch (rows) {  /* each case a copy of row_pass with its row count fixed */
#define ROW_PASS(r) case r: row_pass(r, even, odd, half, row_blocks, row_scales, exponents, groups, row_out, \
                                     out_stride); break;
                ROW_PASS(1) ROW_PASS(2) ROW_PASS(3) ROW_PASS(4) ROW_PASS(5) ROW_PASS(6) ROW_PASS(7) ROW_PASS(8)
#undef ROW_PASS
            }
        }
    }
}

/* out: [r1 - r0, K], contiguous: float32 (bf16 = 0) or bfloat16 (bf16 = 1), each the
 * float32 value's upper half: exact, as an E2M1 value times a power of two has at most
 * two significant bits. */
void mxfp4_dequantize(const uint8_t *blocks, const uint8_t *scales, const float *exponents, void *out,
                      int64_t r0, int64_t r1, int64_t groups, int bf16, int num_threads) {
    const v16i first = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const v16i second = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if ((r1 - r0) * groups * 32 >= PARALLEL_MIN_WEIGHTS)")
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const v16f table = FP4_E2M1 * exponents[scales[r * groups + g]];
            const v16i codes = load_codes(blocks + (r * groups + g) * 16);
            const v16f low = __builtin_shuffle(table, codes & 15);
            const v16f high = __builtin_shuffle(table, codes >> 4);
            const v16f halves[2] = {__builtin_shuffle(low, high, first), __builtin_shuffle(low, high, second)};
            const int64_t offset = ((r - r0) * groups + g) * 32;
            if (!bf16) {
                memcpy((float *)out + offset, halves, sizeof halves);
                continue;
            }
            uint16_t *row_out = (uint16_t *)out + offset;
            for (int half = 0; half < 2; half++) {
                v16i bits;
                memcpy(&bits, &halves[half], sizeof bits);
                const v16u16 upper = __builtin_convertvector((bits >> 16) & 0xffff, v16u16);
                memcpy(row_out + 16 * half, &upper, sizeof upper);
            }
        }
    }
}
