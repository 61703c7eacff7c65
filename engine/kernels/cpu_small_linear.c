/* A small-batch linear for the CPU path: out = x @ w.T (+ bias) on a weight repacked
 * once into blocks of BN = 2 VL outputs, so that a tile of up to MR rows of x streams
 * each block's weights once, every weight vector multiplied by each row's x element
 * broadcast (no horizontal sums). The threads split the output blocks; a block's
 * weights (BN x K) stay in the cache while the row tiles after the first read them.
 *
 *   small_linear_f32:  float32 x, weight and output.
 *   small_linear_bf16: bfloat16 x, weight and output; products summed in float32
 *       (AVX512_BF16's dot-product instruction where the build has it, else the
 *       weights widened in registers), the output rounded to bfloat16 once.
 *
 * Layouts (asserted by the launcher, kernels/cpu_small_linear.py):
 *   x:       [M, K] rows of K contiguous elements, x_stride apart
 *   packed:  float32 [NB, K, BN]; bfloat16 [NB, ceil(K / 2), BN, 2] (pairs of
 *            consecutive k per output, as the dot-product instruction reads them);
 *            NB = ceil(N / BN); outputs past N and the k past an odd K are zero
 *   bias:    float32 [N] or NULL
 *   out:     [M, N] rows out_stride apart, x's dtype
 */
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define BN (2 * VL)
/* Rows of x per tile: MR x 2 accumulators, 2 weight vectors and a broadcast fit the
 * target's vector registers (32 with AVX-512, 16 otherwise). */
#if VL == 16
#define MR 8
#else
#define MR 4
#endif
/* Below this many multiply-adds a call runs on one thread. */
#define PARALLEL_MIN_WORK (1 << 18)
/* How far ahead of the multiply-adds the weights are prefetched, in bytes. */
#define PREFETCH_BYTES 2048

typedef uint32_t vu32 __attribute__((vector_size(4 * VL)));

int small_linear_block(void) { return BN; }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* x in every lane, loaded straight into a vector register (splat's add of zero, which
 * keeps -0.0 apart, is not needed where x only multiplies). */
static inline vf broadcast(const float *x) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(*x);
#elif defined(__AVX2__)
    return (vf)_mm256_broadcast_ss(x);
#else
    return splat(*x);
#endif
}

/* The accumulators' start: the bias of the block's outputs (0 past N), or zero. */
static inline void start_tile(vf acc[MR][2], int rows, const float *bias, int64_t n0, int64_t N) {
    vf start[2] = {splat(0.0f), splat(0.0f)};
    if (bias) {
        float lanes[BN] = {0};
        for (int j = 0; j < BN && n0 + j < N; j++) lanes[j] = bias[n0 + j];
        memcpy(start, lanes, sizeof lanes);
    }
    for (int r = 0; r < rows; r++) {
        acc[r][0] = start[0];
        acc[r][1] = start[1];
    }
}

/* Row r's BN sums into out at column n0 (fewer past N), float32 or rounded to bfloat16. */
static inline void store_row(const vf acc[2], void *out, int64_t n0, int64_t N, int bf16) {
    if (n0 + BN <= N) {
        storev(out, n0, acc[0], bf16);
        storev(out, n0 + VL, acc[1], bf16);
        return;
    }
    float lanes[BN];
    memcpy(lanes, acc, sizeof lanes);
    for (int j = 0; n0 + j < N; j++) {
        if (bf16)
            ((uint16_t *)out)[n0 + j] = f32_to_bf16(lanes[j]);
        else
            ((float *)out)[n0 + j] = lanes[j];
    }
}

/* One tile of ROWS rows (a constant in each instance): float32. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t x_stride, const float *w,
                                                           int64_t K, int rows, vf acc[MR][2]) {
    for (int64_t k = 0; k < K; k++) {
        __builtin_prefetch((const char *)(w + k * BN) + PREFETCH_BYTES);
        vf w0, w1;
        memcpy(&w0, w + k * BN, sizeof w0);
        memcpy(&w1, w + k * BN + VL, sizeof w1);
        for (int r = 0; r < rows; r++) {
            const vf xr = broadcast(x + r * x_stride + k);
            acc[r][0] += xr * w0;
            acc[r][1] += xr * w1;
        }
    }
}

/* One pair of k: the weights' pairs (their two bfloat16 in each 32-bit lane) times
 * each row's pair. */
static inline __attribute__((always_inline)) void pair_bf16(const uint16_t *x, int64_t x_stride, vu32 w0, vu32 w1,
                                                            int rows, int64_t k, int last_odd, vf acc[MR][2]) {
#if DOT_BF16
    for (int r = 0; r < rows; r++) {
        uint32_t pair;
        if (last_odd)
            pair = x[r * x_stride + k];
        else
            memcpy(&pair, x + r * x_stride + k, sizeof pair);
        const vf xr = (vf)((vu32){0} + pair);
        acc[r][0] = dot_bf16(acc[r][0], xr, (vf)w0);
        acc[r][1] = dot_bf16(acc[r][1], xr, (vf)w1);
    }
#else
    const vf even0 = (vf)(w0 << 16), odd0 = (vf)(w0 & 0xffff0000u);
    const vf even1 = (vf)(w1 << 16), odd1 = (vf)(w1 & 0xffff0000u);
    for (int r = 0; r < rows; r++) {
        const vf x0 = splat(bf16_to_f32(x[r * x_stride + k]));
        acc[r][0] += x0 * even0;
        acc[r][1] += x0 * even1;
        if (!last_odd) {
            const vf x1 = splat(bf16_to_f32(x[r * x_stride + k + 1]));
            acc[r][0] += x1 * odd0;
            acc[r][1] += x1 * odd1;
        }
    }
#endif
}

/* One tile of ROWS rows: bfloat16. */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w,
                                                            int64_t K, int rows, vf acc[MR][2]) {
    const int64_t pairs = K / 2;
    vu32 w0, w1;
    for (int64_t p = 0; p < pairs; p++) {
        __builtin_prefetch((const char *)(w + p * 2 * BN) + PREFETCH_BYTES);
        memcpy(&w0, w + p * 2 * BN, sizeof w0);
        memcpy(&w1, w + p * 2 * BN + 2 * VL, sizeof w1);
        pair_bf16(x, x_stride, w0, w1, rows, 2 * p, 0, acc);
    }
    if (K % 2) {  /* the last k alone: its pair's second weight is zero, x's is not read */
        memcpy(&w0, w + pairs * 2 * BN, sizeof w0);
        memcpy(&w1, w + pairs * 2 * BN + 2 * VL, sizeof w1);
        pair_bf16(x, x_stride, w0, w1, rows, 2 * pairs, 1, acc);
    }
}

/* Block b's outputs for rows m0 .. m0 + rows of x. */
static inline __attribute__((always_inline)) void run_tile(const void *x, int64_t x_stride, int64_t m0, int rows,
                                                           const void *packed, const float *bias, void *out,
                                                           int64_t out_stride, int64_t b, int64_t N, int64_t K,
                                                           int bf16) {
    vf acc[MR][2];
    start_tile(acc, rows, bias, b * BN, N);
    if (bf16)
        tile_bf16((const uint16_t *)x + m0 * x_stride, x_stride, (const uint16_t *)packed + b * ((K + 1) / 2) * 2 * BN,
                  K, rows, acc);
    else
        tile_f32((const float *)x + m0 * x_stride, x_stride, (const float *)packed + b * K * BN, K, rows, acc);
    const int64_t element = bf16 ? 2 : 4;
    for (int r = 0; r < rows; r++) store_row(acc[r], (char *)out + (m0 + r) * out_stride * element, b * BN, N, bf16);
}

static void small_linear(const void *x, int64_t x_stride, int64_t M, const void *packed, const float *bias,
                         void *out, int64_t out_stride, int64_t N, int64_t K, int bf16, int num_threads) {
    const int64_t blocks = (N + BN - 1) / BN;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (M * N * K >= PARALLEL_MIN_WORK)")
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            /* One instance per row count, so each keeps its accumulators in registers. */
            switch ((int)min64(M - m0, MR)) {
#define TILE(ROWS) case ROWS: run_tile(x, x_stride, m0, ROWS, packed, bias, out, out_stride, b, N, K, bf16); break;
                TILE(1) TILE(2) TILE(3) TILE(4)
#if MR == 8
                TILE(5) TILE(6) TILE(7) TILE(8)
#endif
#undef TILE
            }
        }
    }
}

void small_linear_f32(const float *x, int64_t x_stride, int64_t M, const float *packed, const float *bias,
                      float *out, int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    small_linear(x, x_stride, M, packed, bias, out, out_stride, N, K, 0, num_threads);
}

void small_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed, const float *bias,
                       uint16_t *out, int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    small_linear(x, x_stride, M, packed, bias, out, out_stride, N, K, 1, num_threads);
}

/* Whether this build multiplies bfloat16 pairs with AVX512_BF16's instruction. */
int small_linear_dot_bf16(void) { return DOT_BF16; }
