/* A small-batch linear for the CPU path: out = x @ w.T (+ bias) on a weight packed
 * in blocks of BN outputs by K (oneDNN's own packed layout on AVX-512, or one packed
 * for this kernel), so that a tile of up to MR rows of x streams each block's weights
 * once, every weight vector multiplied by each row's x element broadcast (no
 * horizontal sums). A tile covers NV vectors of a block's outputs (NV = 4 where a
 * block holds 4 VL outputs, on AVX-512 at any row count: each k's weights are one
 * contiguous stream of whole cache lines, which the first row tile reads from memory
 * while it multiplies as many rows as the registers hold; with 16 registers at up to
 * 2 rows; else 2, the block split in sub-blocks of NV VL outputs).
 * The threads split the output blocks; a block's weights stay in the cache while the
 * row tiles after the first read them.
 *
 *   small_linear_f32:  float32 x, weight and output.
 *   small_linear_bf16: bfloat16 x, weight and output; products summed in float32
 *       (AVX512_BF16's dot-product instruction where the build has it, else the
 *       weights widened in registers), the output rounded to bfloat16 once.
 *
 * Layouts (asserted by the launcher, kernels/cpu_small_linear.py):
 *   x:       [M, K] rows of K contiguous elements, x_stride apart
 *   packed:  float32 [NB, Kp, BN]; bfloat16 [NB, Kp / 2, BN, 2] (pairs of
 *            consecutive k per output, as the dot-product instruction reads them);
 *            NB = ceil(N / BN), Kp >= K (even for bfloat16), block_stride = Kp BN
 *            elements; BN a multiple of 2 VL; outputs past N and k past K are zero
 *   bias:    float32 [N] or NULL
 *   out:     [M, N] rows out_stride apart, x's dtype
 */
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Accumulator vectors per row: NV; rows per tile: MR(NV), so MR x NV accumulators,
 * NV weight vectors and a broadcast fit the target's registers (32 with AVX-512,
 * 16 otherwise). */
#define MAX_NV 4
#if VL == 16
#define MR(NV) ((NV) == 4 ? 6 : 8)
#else
#define MR(NV) ((NV) == 4 ? 2 : 4)
#endif
#define MAX_MR 8
/* Every loop over a tile's rows or vectors is unrolled whole, so its accumulators are
 * registers: left to its own limits the compiler keeps a 6 x 4 tile's in memory, each
 * multiply-add a load and a store of the stack. */
#define PRAGMA(text) _Pragma(#text)
#define UNROLL PRAGMA(GCC unroll 8)
/* Below this many multiply-adds a call runs on one thread. */
#define PARALLEL_MIN_WORK (1 << 18)
/* How many k (pairs of k for bfloat16) ahead of the multiply-adds each of a tile's
 * weight vectors is prefetched: far enough to cover a read from memory. */
#define PREFETCH_K 16

typedef uint32_t vu32 __attribute__((vector_size(4 * VL)));

int small_linear_vector(void) { return VL; }

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

/* The accumulators' start: the bias of outputs n0 .. n0 + NV VL (0 past N), or zero. */
static inline __attribute__((always_inline)) void start_tile(vf acc[MAX_MR][MAX_NV], int rows, int nv,
                                                             const float *bias, int64_t n0, int64_t N) {
    float lanes[MAX_NV * VL] = {0};
    if (bias)
        for (int j = 0; j < nv * VL && n0 + j < N; j++) lanes[j] = bias[n0 + j];
    UNROLL for (int r = 0; r < rows; r++)
        UNROLL for (int v = 0; v < nv; v++) memcpy(&acc[r][v], lanes + v * VL, sizeof(vf));
}

/* A row's NV VL sums into out at column n0 (fewer past N), float32 or rounded to bfloat16. */
static inline __attribute__((always_inline)) void store_row(const vf acc[MAX_NV], int nv, void *out, int64_t n0,
                                                            int64_t N, int bf16) {
    if (n0 + nv * VL <= N) {
        UNROLL for (int v = 0; v < nv; v++) storev(out, n0 + v * VL, acc[v], bf16);
        return;
    }
    float lanes[MAX_NV * VL];
    memcpy(lanes, acc, sizeof(vf) * nv);
    for (int j = 0; j < nv * VL && n0 + j < N; j++) {
        if (bf16)
            ((uint16_t *)out)[n0 + j] = f32_to_bf16(lanes[j]);
        else
            ((float *)out)[n0 + j] = lanes[j];
    }
}

/* ROWS rows by NV vectors (constants in each instance), float32: w points at the
 * sub-block's first k, the next k bn elements on. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t x_stride, const float *w,
                                                           int64_t bn, int64_t K, int rows, int nv,
                                                           vf acc[MAX_MR][MAX_NV]) {
    for (int64_t k = 0; k < K; k++) {
        UNROLL for (int v = 0; v < nv; v++) __builtin_prefetch(w + (k + PREFETCH_K) * bn + v * VL);
        vf wv[MAX_NV];
        UNROLL for (int v = 0; v < nv; v++) memcpy(&wv[v], w + k * bn + v * VL, sizeof(vf));
        UNROLL for (int r = 0; r < rows; r++) {
            const vf xr = broadcast(x + r * x_stride + k);
            UNROLL for (int v = 0; v < nv; v++) acc[r][v] += xr * wv[v];
        }
    }
}

/* One pair of k: the weights' pairs (their two bfloat16 in each 32-bit lane) times
 * each row's pair (its second element zero where last_odd: x's is not read). */
static inline __attribute__((always_inline)) void pair_bf16(const uint16_t *x, int64_t x_stride,
                                                            const vu32 wv[MAX_NV], int rows, int nv, int64_t k,
                                                            int last_odd, vf acc[MAX_MR][MAX_NV]) {
#if DOT_BF16
    UNROLL for (int r = 0; r < rows; r++) {
        uint32_t pair;
        if (last_odd)
            pair = x[r * x_stride + k];
        else
            memcpy(&pair, x + r * x_stride + k, sizeof pair);
        const vf xr = (vf)((vu32){0} + pair);
        UNROLL for (int v = 0; v < nv; v++) acc[r][v] = dot_bf16(acc[r][v], xr, (vf)wv[v]);
    }
#else
    vf even[MAX_NV], odd[MAX_NV];
    UNROLL for (int v = 0; v < nv; v++) {
        even[v] = (vf)(wv[v] << 16);
        odd[v] = (vf)(wv[v] & 0xffff0000u);
    }
    UNROLL for (int r = 0; r < rows; r++) {
        const vf x0 = splat(bf16_to_f32(x[r * x_stride + k]));
        UNROLL for (int v = 0; v < nv; v++) acc[r][v] += x0 * even[v];
        if (!last_odd) {
            const vf x1 = splat(bf16_to_f32(x[r * x_stride + k + 1]));
            UNROLL for (int v = 0; v < nv; v++) acc[r][v] += x1 * odd[v];
        }
    }
#endif
}

/* ROWS rows by NV vectors, bfloat16: w points at the sub-block's first pair, the next
 * pair 2 bn elements on. */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w,
                                                            int64_t bn, int64_t K, int rows, int nv,
                                                            vf acc[MAX_MR][MAX_NV]) {
    const int64_t pairs = K / 2;
    vu32 wv[MAX_NV];
    for (int64_t p = 0; p <= pairs; p++) {
        if (p == pairs && K % 2 == 0) break;
        const uint16_t *row = w + p * 2 * bn;
        UNROLL for (int v = 0; v < nv; v++) __builtin_prefetch(row + PREFETCH_K * 2 * bn + v * 2 * VL);
        UNROLL for (int v = 0; v < nv; v++) memcpy(&wv[v], row + v * 2 * VL, sizeof(vu32));
        pair_bf16(x, x_stride, wv, rows, nv, 2 * p, p == pairs, acc);
    }
}

/* Outputs n0 .. n0 + NV VL for rows m0 .. m0 + rows of x; w: the sub-block's weights. */
static inline __attribute__((always_inline)) void run_tile(const void *x, int64_t x_stride, int64_t m0, int rows,
                                                           int nv, const void *w, int64_t bn, const float *bias,
                                                           void *out, int64_t out_stride, int64_t n0, int64_t N,
                                                           int64_t K, int bf16) {
    vf acc[MAX_MR][MAX_NV];
    start_tile(acc, rows, nv, bias, n0, N);
    if (bf16)
        tile_bf16((const uint16_t *)x + m0 * x_stride, x_stride, w, bn, K, rows, nv, acc);
    else
        tile_f32((const float *)x + m0 * x_stride, x_stride, w, bn, K, rows, nv, acc);
    const int64_t element = bf16 ? 2 : 4;
    UNROLL for (int r = 0; r < rows; r++)
        store_row(acc[r], nv, (char *)out + (m0 + r) * out_stride * element, n0, N, bf16);
}

/* Every row tile of one sub-block of NV vectors. */
static inline __attribute__((always_inline)) void run_sub_block(const void *x, int64_t x_stride, int64_t M, int nv,
                                                                const void *w, int64_t bn, const float *bias,
                                                                void *out, int64_t out_stride, int64_t n0, int64_t N,
                                                                int64_t K, int bf16) {
    const int mr = MR(nv);
    for (int64_t m0 = 0; m0 < M; m0 += mr) {
        /* One instance per row count, so each keeps its accumulators in registers. */
        switch ((int)min64(M - m0, mr)) {
#define TILE(ROWS) case ROWS: run_tile(x, x_stride, m0, ROWS, nv, w, bn, bias, out, out_stride, n0, N, K, bf16); break;
            TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
        }
    }
}

static inline __attribute__((always_inline)) void small_linear(const void *x, int64_t x_stride, int64_t M,
                                                               const void *packed, int64_t bn, int64_t block_stride,
                                                               const float *bias, void *out, int64_t out_stride,
                                                               int64_t N, int64_t K, int bf16, int num_threads) {
    const int64_t blocks = (N + bn - 1) / bn;
    /* With AVX-512's 32 registers a tile reads whole rows of a block's k at once,
     * MR(4) rows of them; with 16 registers, up to MR(4) rows (bound by reading the
     * weights) read 4 vectors of each k, more the taller tiles of 2. */
    const int nv = bn % (4 * VL) == 0 && (VL == 16 || M <= MR(4)) ? 4 : 2;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (M * N * K >= PARALLEL_MIN_WORK)")
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t s = 0; s < bn && b * bn + s < N; s += nv * VL) {
            /* bfloat16 blocks hold pairs: sub-block s starts 2 s elements into each pair row. */
            const int64_t offset = b * block_stride + (bf16 ? 2 * s : s);
            const void *w = bf16 ? (const void *)((const uint16_t *)packed + offset)
                                 : (const void *)((const float *)packed + offset);
            if (nv == 4)
                run_sub_block(x, x_stride, M, 4, w, bn, bias, out, out_stride, b * bn + s, N, K, bf16);
            else
                run_sub_block(x, x_stride, M, 2, w, bn, bias, out, out_stride, b * bn + s, N, K, bf16);
        }
    }
}

void small_linear_f32(const float *x, int64_t x_stride, int64_t M, const float *packed, int64_t bn,
                      int64_t block_stride, const float *bias, float *out, int64_t out_stride, int64_t N, int64_t K,
                      int num_threads) {
    small_linear(x, x_stride, M, packed, bn, block_stride, bias, out, out_stride, N, K, 0, num_threads);
}

void small_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed, int64_t bn,
                       int64_t block_stride, const float *bias, uint16_t *out, int64_t out_stride, int64_t N,
                       int64_t K, int num_threads) {
    small_linear(x, x_stride, M, packed, bn, block_stride, bias, out, out_stride, N, K, 1, num_threads);
}

/* Whether this build multiplies bfloat16 pairs with AVX512_BF16's instruction. */
int small_linear_dot_bf16(void) { return DOT_BF16; }
