/* A small-batch linear for the CPU path: out = x @ w.T (+ bias) on a weight packed
 * in blocks of BN outputs by K (oneDNN's own packed layout on AVX-512, or one packed
 * for this kernel), so that a tile of up to MR rows of x streams each block's weights
 * once, every weight vector multiplied by each row's x element broadcast (no
 * horizontal sums). A tile covers NV vectors of a block's outputs (NV = 4 where a
 * block holds 4 VL outputs, on AVX-512 at any row count: each k's weights are one
 * contiguous stream of whole cache lines; with 16 registers at up to 2 rows; else 2,
 * the block split in sub-blocks of NV VL outputs).
 *
 * Each block is walked in chunks of its k (CHUNK_BYTES of weights), and every row
 * tile of a group of rows runs over a chunk before any runs over the next: the first
 * tile reads the chunk from L2 and the others from L1, their sums waiting between
 * chunks in a buffer. While the tiles run, each fetches its share of the next chunk
 * (the next block's first after the last), so the weights stream from memory all
 * the time the arithmetic runs instead of only while a block's first tile does: at
 * 8-64 rows a step's linears are bound by both, and the time is the larger of the
 * two, not their sum. The threads split the output blocks.
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
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
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
#define MR(NV) ((NV) == 4 ? 2 : 6)
#endif
#define MAX_MR 8
/* Every loop over a tile's rows or vectors is unrolled whole, so its accumulators are
 * registers: left to its own limits the compiler keeps a 6 x 4 tile's in memory, each
 * multiply-add a load and a store of the stack. */
#define PRAGMA(text) _Pragma(#text)
#define UNROLL PRAGMA(GCC unroll 8)
/* Below this many multiply-adds a call runs on one thread. */
#define PARALLEL_MIN_WORK (1 << 18)
/* A block is walked in chunks of about this many bytes of weights (whole k, or pairs
 * of k for bfloat16), every row tile of a group over one chunk before the next: the
 * group's first tile reads the chunk from memory or L2, the others from L1. With 16
 * registers a tile covers a quarter of a 64-output block's k and its sums are moved
 * in and out of the buffer at every chunk, so past LONG_CHUNK_ROWS rows (bound by the
 * arithmetic, not by reading the weights) chunks are LONG_CHUNK_BYTES: fewer such
 * moves per multiply-add. */
#define CHUNK_BYTES 16384
#if VL == 16
#define LONG_CHUNK_BYTES CHUNK_BYTES
#else
#define LONG_CHUNK_BYTES 65536
#endif
#define LONG_CHUNK_ROWS 8
/* float32 steps per turn of a tile's loop: with 16 registers, the loop's own counting
 * and jumping otherwise takes a visible share of the issue slots between the 12
 * multiply-adds of a 6 x 2 tile. */
#if VL == 16
#define STEP_UNROLL 1
#else
#define STEP_UNROLL 4
#endif
#define UNROLL_BY(N) PRAGMA(GCC unroll N)
/* Rows of a group: GROUP_TILES tiles, whose sums between chunks wait in a buffer of
 * GROUP_TILES MAX_MR rows by MAX_BN outputs (the launcher asserts BN <= MAX_BN). */
#define GROUP_TILES 8
#define MAX_BN 128
/* Prefetched lines go to L2 (hint 2) or L1 (3). */
#define PREFETCH_HINT 2

typedef uint32_t vu32 __attribute__((vector_size(4 * VL)));

int small_linear_vector(void) { return VL; }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* One call's operands (see the layouts above). A step is one k of float32 or one pair
 * of k of bfloat16: BN 32-bit lanes of a block, bn 4 bytes, either way. */
typedef struct {
    const void *x;
    int64_t x_stride, M;
    const char *packed;
    int64_t bn, block_bytes, blocks;
    const float *bias;
    void *out;
    int64_t out_stride, N, K, steps;
} call_t;

/* A tile's share of the next chunk's weights, fetched while the tile multiplies this
 * chunk's: the weights stream from memory while every tile runs, not only the first.
 * Lines of 64 bytes from ``lines``, ``per_step`` of them at each step, ``count`` in all. */
typedef struct {
    const char *lines;
    int64_t per_step, count;
} ahead_t;

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

/* One step (one k) of float32: the step's NV weight vectors times each row's x[k]
 * (rows[r] points at row r of x: one register per row, indexed by k, so a step
 * computes no row addresses). */
static inline __attribute__((always_inline)) void step_f32(const float *const rows_x[MAX_MR], const char *w,
                                                           int rows, int nv, int64_t k, vf acc[MAX_MR][MAX_NV]) {
    vf wv[MAX_NV];
    UNROLL for (int v = 0; v < nv; v++) memcpy(&wv[v], w + v * sizeof(vf), sizeof(vf));
    UNROLL for (int r = 0; r < rows; r++) {
        const vf xr = broadcast(rows_x[r] + k);
        UNROLL for (int v = 0; v < nv; v++) acc[r][v] += xr * wv[v];
    }
}

/* One step (pair of k) of bfloat16: the weights' pairs (their two bfloat16 in each
 * 32-bit lane) times each row's pair (its second element zero where last_odd: x's is
 * not read). */
static inline __attribute__((always_inline)) void step_bf16(const uint16_t *x, int64_t x_stride, const char *w,
                                                            int rows, int nv, int64_t k, int last_odd,
                                                            vf acc[MAX_MR][MAX_NV]) {
    vu32 wv[MAX_NV];
    UNROLL for (int v = 0; v < nv; v++) memcpy(&wv[v], w + v * sizeof(vu32), sizeof(vu32));
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

/* Steps p0 .. p1 of ROWS rows (from row m0) by NV vectors, PER of the next chunk's
 * lines prefetched at each (constants in each instance); w points at the
 * sub-block's step p0, the next step bn 4 bytes on. */
static inline __attribute__((always_inline)) void steps_per(const call_t *call, int64_t m0, int rows, int nv,
                                                            const char *w, int64_t p0, int64_t p1,
                                                            const char *lines, int per, int bf16,
                                                            vf sums[MAX_MR][MAX_NV]) {
    const int64_t step_bytes = call->bn * 4;
    /* The loop's own copy of the sums: on the caller's array (its address taken for
     * the buffer between chunks) GCC stores the 2-vector tiles' sums to the stack at
     * every step of the AVX2 builds. */
    vf acc[MAX_MR][MAX_NV];
    UNROLL for (int r = 0; r < rows; r++)
        UNROLL for (int v = 0; v < nv; v++) acc[r][v] = sums[r][v];
    if (bf16) {
        const uint16_t *x = (const uint16_t *)call->x + m0 * call->x_stride;
        const int64_t whole = min64(p1, call->K / 2);  /* pairs with both k in x */
        for (int64_t p = p0; p < whole; p++) {
            UNROLL for (int j = 0; j < per; j++) __builtin_prefetch(lines + 64 * ((p - p0) * per + j), 0, PREFETCH_HINT);
            step_bf16(x, call->x_stride, w + (p - p0) * step_bytes, rows, nv, 2 * p, 0, acc);
        }
        if (whole < p1)  /* the last, odd k */
            step_bf16(x, call->x_stride, w + (whole - p0) * step_bytes, rows, nv, 2 * whole, 1, acc);
    } else {
        const float *rows_x[MAX_MR];
        UNROLL for (int r = 0; r < rows; r++) rows_x[r] = (const float *)call->x + (m0 + r) * call->x_stride;
        UNROLL_BY(STEP_UNROLL) for (int64_t p = p0; p < p1; p++) {
            UNROLL for (int j = 0; j < per; j++) __builtin_prefetch(lines + 64 * ((p - p0) * per + j), 0, PREFETCH_HINT);
            step_f32(rows_x, w + (p - p0) * step_bytes, rows, nv, p, acc);
        }
    }
    UNROLL for (int r = 0; r < rows; r++)
        UNROLL for (int v = 0; v < nv; v++) sums[r][v] = acc[r][v];
}

/* Steps p0 .. p1 with the tile's share of the next chunk prefetched, per_step lines
 * (1-4) at every step from the start of its share, or none where ``count`` is 0.
 * The rate is the share over the chunk's steps, rounded up: each tile's requests
 * spread over its whole run, so the chunk's tiles keep the next chunk's lines coming
 * evenly while they multiply, where a higher rate issues them all from the first
 * tiles and leaves the rest of the chunk's run without requests. Rounded up, a
 * tile's requests reach past its share: there lie the next tile's lines (fetched
 * twice) or lines further on, which no fetch can fault on. At most 4 a step: each
 * rate is an instance of every tile, and the build's time grows with them. */
static inline __attribute__((always_inline)) void tile_steps(const call_t *call, int64_t m0, int rows, int nv,
                                                             const char *w, int64_t p0, int64_t p1, ahead_t ahead,
                                                             int bf16, vf acc[MAX_MR][MAX_NV]) {
    switch (ahead.count > 0 ? (int)ahead.per_step : 0) {
#define PER(N) case N: steps_per(call, m0, rows, nv, w, p0, p1, ahead.lines, N, bf16, acc); break;
        PER(0) PER(1) PER(2) PER(3) PER(4)
#undef PER
    }
}

/* One tile over one chunk: sums start from the bias at the first chunk and from
 * ``partial`` (this tile's rows, from the group's first) after it, and go to out at
 * the last chunk and to ``partial`` before it. */
static inline __attribute__((always_inline)) void run_tile(const call_t *call, int64_t m0, int rows, int nv,
                                                           const char *w, int64_t n0, int64_t p0, int64_t p1,
                                                           ahead_t ahead, float (*partial)[MAX_BN], int64_t s,
                                                           int bf16) {
    vf acc[MAX_MR][MAX_NV];
    if (p0 == 0)
        start_tile(acc, rows, nv, call->bias, n0, call->N);
    else
        UNROLL for (int r = 0; r < rows; r++)
            UNROLL for (int v = 0; v < nv; v++) memcpy(&acc[r][v], partial[r] + s + v * VL, sizeof(vf));
    tile_steps(call, m0, rows, nv, w, p0, p1, ahead, bf16, acc);
    const int64_t element = bf16 ? 2 : 4;
    if (p1 == call->steps)
        UNROLL for (int r = 0; r < rows; r++)
            store_row(acc[r], nv, (char *)call->out + (m0 + r) * call->out_stride * element, n0, call->N, bf16);
    else
        UNROLL for (int r = 0; r < rows; r++)
            UNROLL for (int v = 0; v < nv; v++) memcpy(partial[r] + s + v * VL, &acc[r][v], sizeof(vf));
}

/* Every row tile of rows g0 .. g0 + rows of sub-block s of block b over steps
 * p0 .. p1; ``next``: the next chunk's lines, shared out over the chunk's tiles
 * (``tiles`` in all, this sub-block's from ``first``). */
static inline __attribute__((always_inline)) void run_sub_block(const call_t *call, int64_t b, int64_t s, int nv,
                                                                int64_t g0, int64_t rows, int64_t p0, int64_t p1,
                                                                ahead_t next, int64_t first, int64_t tiles,
                                                                float (*partial)[MAX_BN], int bf16) {
    const int mr = MR(nv);
    const char *w = call->packed + b * call->block_bytes + p0 * call->bn * 4 + s * 4;
    const int64_t share = (next.count + tiles - 1) / tiles;
    for (int64_t t = 0; t * mr < rows; t++) {
        const int64_t done = min64((first + t) * share, next.count);
        const ahead_t ahead = {next.lines + 64 * done, min64((share + p1 - p0 - 1) / (p1 - p0), 4),
                                min64(share, next.count - done)};
        /* One instance per row count, so each keeps its accumulators in registers. */
        switch ((int)min64(rows - t * mr, mr)) {
#define TILE(ROWS) case ROWS: run_tile(call, g0 + t * mr, ROWS, nv, w, b * call->bn + s, p0, p1, ahead, \
                                       partial + t * mr, s, bf16); break;
            TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
        }
    }
}

/* Rows g0 .. g0 + rows (at most GROUP_TILES tiles) of block b, chunk by chunk. */
static inline __attribute__((always_inline)) void run_group(const call_t *call, int64_t b, int nv, int64_t g0,
                                                            int64_t rows, int bf16) {
    float partial[GROUP_TILES * MAX_MR][MAX_BN] __attribute__((aligned(64)));
    const int64_t chunk_bytes = call->M > LONG_CHUNK_ROWS ? LONG_CHUNK_BYTES : CHUNK_BYTES;
    const int64_t chunk = chunk_bytes / (call->bn * 4) > 0 ? chunk_bytes / (call->bn * 4) : 1;
    const int64_t bn = min64(call->bn, call->N - b * call->bn), mr = MR(nv);
    const int64_t tiles = (bn + nv * VL - 1) / (nv * VL) * ((rows + mr - 1) / mr);
    const char *end = call->packed + call->blocks * call->block_bytes, *block = call->packed + b * call->block_bytes;
    const int last_group = g0 + rows == call->M;
    for (int64_t p0 = 0; p0 < call->steps; p0 += chunk) {
        const int64_t p1 = min64(p0 + chunk, call->steps);
        /* The next chunk of this block, else (after the last group's last chunk) the next block's first. */
        const char *lines = p1 < call->steps ? block + p1 * call->bn * 4 : block + call->block_bytes;
        const int64_t bytes = p1 < call->steps || last_group ? min64(chunk * call->bn * 4, end - lines) : 0;
        const ahead_t next = {lines, 0, bytes > 0 ? bytes / 64 : 0};
        for (int64_t s = 0; s < bn; s += nv * VL) {
            const int64_t first = s / (nv * VL) * ((rows + mr - 1) / mr);
            if (nv == 4)
                run_sub_block(call, b, s, 4, g0, rows, p0, p1, next, first, tiles, partial, bf16);
            else
                run_sub_block(call, b, s, 2, g0, rows, p0, p1, next, first, tiles, partial, bf16);
        }
    }
}

static inline __attribute__((always_inline)) void small_linear(const call_t *call, int bf16, int num_threads) {
    /* With AVX-512's 32 registers a tile reads whole rows of a block's k at once,
     * MR(4) rows of them; with 16 registers, up to MR(4) rows (bound by reading the
     * weights) read 4 vectors of each k, more the taller tiles of 2. */
    const int nv = call->bn % (4 * VL) == 0 && (VL == 16 || call->M <= MR(4)) ? 4 : 2;
    const int64_t group_rows = GROUP_TILES * MR(nv), M = call->M;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (M * call->N * call->K >= PARALLEL_MIN_WORK)")
    for (int64_t b = 0; b < call->blocks; b++)
        for (int64_t g0 = 0; g0 < M; g0 += group_rows)
            run_group(call, b, nv, g0, min64(group_rows, M - g0), bf16);
}

#if HAVE_AMX_BF16 && VL == 16
/* ---- bfloat16 through AMX tiles, where the build and host have AMX-BF16 ----
 *
 * A block's weights are already AMX's layout of B tiles: each step (a pair of k) holds
 * BN outputs' pairs, so 16 steps by 16 outputs (64 bytes of each step) are one tile,
 * read in place with the step's bytes as its stride. A tile of 16 rows of x by 32 k
 * (read in place too) is the A side; four C tiles hold 16 rows by 64 outputs, started
 * from the bias, and every tile multiply sums exact products of bfloat16 values in
 * float32 (subnormal inputs and sums taken as zero) as the dot-product instruction
 * does. The threads split the blocks, and every row tile of a block runs before the
 * next block: the block is read from memory once, by its first row tile, which asks
 * for the lines AHEAD_CHUNKS runs of 32 k ahead of those it multiplies (every other
 * line: the L2's pair prefetch brings the rest), the next block's first ones near the
 * end. A tile load waits for lines it misses, so the weights must be there before
 * it: the hardware prefetchers alone left it waiting on most. Rows past the last whole
 * 16 are copied into a zero-padded tile of x first, so every tile is 16 rows (one tile
 * configuration a thread). One row runs on the vector kernel, which streams the
 * weights as fast with fewer instructions; K must be whole runs of 32 and BN of 16. */
#define AMX_ROWS 16
#define AMX_MIN_ROWS 2
#define AMX_GROUPS 4  /* C tiles: 16 outputs each */
#define AHEAD_CHUNKS 3
#define AHEAD_STRIDE 128

/* Tiles 0-3: sums (C); 4: x (A); 5, 6: weights (B); all 16 rows of 64 bytes. */
static void amx_configure(void) {
    const uint8_t rows[7] = {16, 16, 16, 16, 16, 16, 16};
    const uint16_t bytes[7] = {64, 64, 64, 64, 64, 64, 64};
    amx_load_config(7, rows, bytes);
}

/* 16 rows of x (x_bytes apart, from x) by outputs s .. s + 16 groups of block b, over
 * all k, the first `rows` of them into out from row m0; with `fetch`, the weights'
 * lines ahead are asked for (up to `end`, the packed weight's). */
static inline __attribute__((always_inline)) void amx_row_tile(const call_t *call, int64_t b, int64_t s, int groups,
                                                               const uint16_t *x, int64_t x_bytes, int64_t m0,
                                                               int rows, const float *bias_lanes, int fetch,
                                                               const char *end) {
    const int64_t step_bytes = call->bn * 4, chunk_bytes = 16 * step_bytes;
    const char *block = call->packed + b * call->block_bytes;
    /* The sums start from the bias (one row read 16 times: stride 0), as the vector kernel's do. */
    _tile_loadd(0, bias_lanes, 0);
    _tile_loadd(1, bias_lanes + 16, 0);
    _tile_loadd(2, bias_lanes + 32, 0);
    _tile_loadd(3, bias_lanes + 48, 0);
    for (int64_t k = 0; k < call->K; k += 32) {
        const char *chunk = block + k / 2 * step_bytes, *wk = chunk + s * 4;
        if (fetch) {
            const char *ahead = chunk + AHEAD_CHUNKS * chunk_bytes;  /* past the block: the next one's */
            for (int64_t byte = 0; byte < chunk_bytes && ahead + byte < end; byte += AHEAD_STRIDE)
                __builtin_prefetch(ahead + byte, 0, PREFETCH_HINT);
        }
        _tile_loadd(4, x + k, x_bytes);
        _tile_loadd(5, wk, step_bytes);
        _tile_dpbf16ps(0, 4, 5);
        if (groups > 1) {
            _tile_loadd(6, wk + 64, step_bytes);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (groups > 2) {
            _tile_loadd(5, wk + 128, step_bytes);
            _tile_dpbf16ps(2, 4, 5);
        }
        if (groups > 3) {
            _tile_loadd(6, wk + 192, step_bytes);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    float sums[AMX_ROWS][AMX_GROUPS * 16] __attribute__((aligned(64)));
    const int64_t sums_bytes = sizeof sums[0];
    _tile_stored(0, sums[0], sums_bytes);
    _tile_stored(1, sums[0] + 16, sums_bytes);
    _tile_stored(2, sums[0] + 32, sums_bytes);
    _tile_stored(3, sums[0] + 48, sums_bytes);
    for (int r = 0; r < rows; r++) {
        vf acc[MAX_NV];
        UNROLL for (int v = 0; v < AMX_GROUPS; v++) memcpy(&acc[v], sums[r] + 16 * v, sizeof(vf));
        store_row(acc, groups, (uint16_t *)call->out + (m0 + r) * call->out_stride, b * call->bn + s, call->N, 1);
    }
}

/* The bfloat16 call through the tiles; 0 (nothing written) where they do not take it. */
static int small_linear_amx(const call_t *call, int num_threads) {
    if (call->M < AMX_MIN_ROWS || call->K % 32 || call->bn % 16 || call->bn > MAX_BN || !amx_ready()) return 0;
    const int64_t M = call->M, whole = M - M % AMX_ROWS, tail = M % AMX_ROWS;
    uint16_t *padded = NULL;  /* the rows past the last whole 16, zero past M */
    if (tail) {
        padded = calloc((size_t)(AMX_ROWS * call->K), sizeof(uint16_t));
        if (padded == NULL) return 0;
        for (int64_t r = 0; r < tail; r++)
            memcpy(padded + r * call->K, (const uint16_t *)call->x + (whole + r) * call->x_stride,
                   (size_t)call->K * sizeof(uint16_t));
    }
    const char *end = call->packed + call->blocks * call->block_bytes;
    _Pragma("omp parallel num_threads(num_threads) if (M * call->N * call->K >= PARALLEL_MIN_WORK)")
    {
        amx_configure();
        _Pragma("omp for schedule(static)")
        for (int64_t b = 0; b < call->blocks; b++) {
            const int64_t bn = min64(call->bn, call->N - b * call->bn);
            for (int64_t s = 0; s < bn; s += 16 * AMX_GROUPS) {
                float bias_lanes[AMX_GROUPS * 16] __attribute__((aligned(64))) = {0};
                for (int64_t j = 0; call->bias && j < AMX_GROUPS * 16 && b * call->bn + s + j < call->N; j++)
                    bias_lanes[j] = call->bias[b * call->bn + s + j];
                const int groups = (int)min64((bn - s + 15) / 16, AMX_GROUPS);
                for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
                    const int fetch = m0 == 0 && s == 0;  /* the block's first pass reads it from memory */
                    if (m0 < whole)
                        amx_row_tile(call, b, s, groups, (const uint16_t *)call->x + m0 * call->x_stride,
                                     call->x_stride * 2, m0, AMX_ROWS, bias_lanes, fetch, end);
                    else
                        amx_row_tile(call, b, s, groups, padded, call->K * 2, m0, (int)tail, bias_lanes, fetch, end);
                }
            }
        }
        _tile_release();
    }
    free(padded);
    return 1;
}
#endif

/* The call's operands, with BN and the block's stride (elements) as the launcher passes them. */
static inline call_t make_call(const void *x, int64_t x_stride, int64_t M, const void *packed, int64_t bn,
                               int64_t block_stride, const float *bias, void *out, int64_t out_stride, int64_t N,
                               int64_t K, int bf16) {
    const int64_t element = bf16 ? 2 : 4;
    return (call_t){x, x_stride, M, (const char *)packed, bn, block_stride * element, (N + bn - 1) / bn, bias, out,
                    out_stride, N, K, bf16 ? (K + 1) / 2 : K};
}

void small_linear_f32(const float *x, int64_t x_stride, int64_t M, const float *packed, int64_t bn,
                      int64_t block_stride, const float *bias, float *out, int64_t out_stride, int64_t N, int64_t K,
                      int num_threads) {
    const call_t call = make_call(x, x_stride, M, packed, bn, block_stride, bias, out, out_stride, N, K, 0);
    small_linear(&call, 0, num_threads);
}

void small_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed, int64_t bn,
                       int64_t block_stride, const float *bias, uint16_t *out, int64_t out_stride, int64_t N,
                       int64_t K, int num_threads) {
    const call_t call = make_call(x, x_stride, M, packed, bn, block_stride, bias, out, out_stride, N, K, 1);
#if HAVE_AMX_BF16 && VL == 16
    if (small_linear_amx(&call, num_threads)) return;
#endif
    small_linear(&call, 1, num_threads);
}

/* Whether this build multiplies bfloat16 pairs with AVX512_BF16's instruction. */
int small_linear_dot_bf16(void) { return DOT_BF16; }

/* Whether bfloat16 calls multiply through AMX tiles here, and allowing them or not (tests). */
int small_linear_amx_ready(void) { return HAVE_AMX_BF16 && VL == 16 && amx_ready(); }
void small_linear_amx_allow(int allowed) { __atomic_store_n(&amx_allowed, allowed, __ATOMIC_RELAXED); }
