/* Paged decode attention for the CPU path: one query token per request, read
 * straight out of the paged KV cache through the block tables.
 *
 * Work item = (request, a run of its KV heads: all of them unless the threads need
 * more items). The G = H / Hkv query heads of a KV head share every key and value
 * row read, and each row of the context is read once, as one contiguous run: an online softmax over
 * one block of keys at a time (running max m, running sum l, accumulator acc,
 * rescaled by exp(m_old - m_new) when the max grows). Items run in parallel
 * (OpenMP, dynamic schedule: contexts differ in length).
 *
 * float32, float64 and bfloat16 caches; bfloat16 is read into float32 and
 * accumulates there, which halves the bytes a decode step reads (its keys' scores by
 * AVX512_BF16's dot-product instruction where the target has it: DOT_BF16 below).
 *
 * float32 and bfloat16 caches whose head sizes are multiples of the target's vector
 * width go through the vector item (below DEFINE_ITEM: explicit vectors of the
 * target's width, cpu_common.h); the rest, and float64, through DEFINE_ITEM's loops.
 * Common head sizes get their own instance with the head size a compile-time
 * constant, so the compiler unrolls the inner loops.
 *
 * Layouts (asserted by the Python launcher, kernels/cpu_attention.py):
 *   q:            [T, H, D], D contiguous, strides q_stride_t, q_stride_h (elements)
 *   k_cache:      [num_blocks, block_size, Hkv, D] contiguous
 *   v_cache:      [num_blocks, block_size, Hkv, Dv] contiguous (Dv may differ from D)
 *   block_tables: [B, table_stride] int32
 *   seq_lens:     [B] int64: context length including the new token
 *   query_rows:   [B] int64: packed row of each request's query token
 *   requests:     [n] int64: which of the B requests to attend (decoding ones)
 *   out:          [T, H, Dv] contiguous
 *   sinks:        [H] float64 or NULL: a logit per head in each softmax's denominator
 *   alibi:        [H] float64 or NULL: slope_h * (key - query position) added to scores
 * window > 0 keeps the last `window` positions; chunk > 0 keeps the positions of
 * the query's aligned chunk of `chunk`; softcap > 0 applies
 * softcap * tanh(score / softcap) before the softmax (after ALiBi). A sink starts
 * the online softmax: running max = sink, running sum = 1, no value.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#define MAX_GROUP 32
/* Query heads one work item attends (KV heads per item x group). */
#define MAX_ITEM_HEADS 64
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 128


#define DEFINE_ITEM(NAME, T, ACC, EXP, TANH, LOAD, STORE)                                   \
static inline __attribute__((always_inline)) void NAME(                                     \
    const T *q, int64_t q_stride_t, int64_t q_stride_h, const T *k_cache, const T *v_cache, \
    const int32_t *table, int64_t seq_len, int64_t query_row, T *out, int64_t h0,           \
    int64_t num_item_heads, int64_t group, int64_t num_heads, int64_t row_stride,           \
    int64_t v_row_stride, const int64_t head_dim, const int64_t head_dim_v,                 \
    int64_t block_size, ACC scale, int64_t window, ACC softcap, const double *sinks,        \
    const double *alibi, int64_t chunk)                                                     \
{                                                                                           \
    /* Rows i = 0 .. n-1 are the item's query heads h0 * group + i; query head i reads      \
     * KV head h0 + i / group. */                                                           \
    const int64_t n = num_item_heads * group;                                               \
    const int64_t query_pos = seq_len - 1;                                                  \
    int64_t first = (window > 0 && seq_len > window) ? seq_len - window : 0;                \
    if (chunk > 0 && query_pos - query_pos % chunk > first) first = query_pos - query_pos % chunk; \
    ACC qs[MAX_ITEM_HEADS][MAX_HEAD_DIM];                                                   \
    ACC acc[MAX_ITEM_HEADS][MAX_HEAD_DIM];                                                  \
    ACC m[MAX_ITEM_HEADS], l[MAX_ITEM_HEADS];                                               \
    ACC scores[MAX_ITEM_HEADS][MAX_BLOCK];                                                  \
    for (int64_t i = 0; i < n; i++) {                                                       \
        const T *qh = q + query_row * q_stride_t + (h0 * group + i) * q_stride_h;           \
        for (int64_t d = 0; d < head_dim; d++) qs[i][d] = LOAD(qh[d]) * scale;              \
        for (int64_t d = 0; d < head_dim_v; d++) acc[i][d] = 0;                             \
        m[i] = sinks ? (ACC)sinks[h0 * group + i] : -INFINITY;                              \
        l[i] = sinks ? 1 : 0;                                                               \
    }                                                                                       \
    for (int64_t start = first - first % block_size; start < seq_len; start += block_size) { \
        const int64_t block = table[start / block_size];                                    \
        const int64_t lo = start < first ? first - start : 0;                               \
        const int64_t hi = seq_len - start < block_size ? seq_len - start : block_size;     \
        const T *kb = k_cache + block * block_size * row_stride + h0 * head_dim;            \
        const T *vb = v_cache + block * block_size * v_row_stride + h0 * head_dim_v;        \
        /* Blocks lie anywhere in memory: fetch the one two ahead into L2 while this one is \
         * computed (on a 2-core Zen worker, one ahead into L1 ran 30% slower, one ahead    \
         * into L2 10% slower). */                                                          \
        const int64_t next = start + 2 * block_size < seq_len ? table[start / block_size + 2] : block; \
        const char *next_k = (const char *)(k_cache + next * block_size * row_stride + h0 * head_dim); \
        const char *next_v = (const char *)(v_cache + next * block_size * v_row_stride + h0 * head_dim_v); \
        const int64_t run_bytes = num_item_heads * head_dim * (int64_t)sizeof(T);           \
        const int64_t v_run_bytes = num_item_heads * head_dim_v * (int64_t)sizeof(T);       \
        for (int64_t j = lo; j < hi; j++) {                                                 \
            for (int64_t byte = 0; byte < run_bytes; byte += 64)                            \
                __builtin_prefetch(next_k + j * row_stride * (int64_t)sizeof(T) + byte, 0, 1);    \
            for (int64_t byte = 0; byte < v_run_bytes; byte += 64)                          \
                __builtin_prefetch(next_v + j * v_row_stride * (int64_t)sizeof(T) + byte, 0, 1);  \
            for (int64_t kv = 0, i = 0; kv < num_item_heads; kv++) {                        \
                const T *kr = kb + j * row_stride + kv * head_dim;                          \
                for (int64_t g = 0; g < group; g++, i++) {                                  \
                    ACC s = 0;                                                              \
                    _Pragma("omp simd reduction(+:s)")                                      \
                    for (int64_t d = 0; d < head_dim; d++) s += qs[i][d] * LOAD(kr[d]);     \
                    scores[i][j] = s;                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int64_t i = 0; i < n; i++) {                                                   \
            ACC block_max = m[i];                                                           \
            if (alibi) {                                                                    \
                const ACC slope = (ACC)alibi[h0 * group + i];                               \
                for (int64_t j = lo; j < hi; j++) scores[i][j] += slope * (ACC)(start + j - query_pos); \
            }                                                                               \
            if (softcap > 0)                                                                \
                for (int64_t j = lo; j < hi; j++) scores[i][j] = softcap * TANH(scores[i][j] / softcap); \
            for (int64_t j = lo; j < hi; j++) block_max = scores[i][j] > block_max ? scores[i][j] : block_max; \
            const ACC correction = EXP(m[i] - block_max);                                   \
            ACC block_sum = 0;                                                              \
            _Pragma("omp simd reduction(+:block_sum)")                                      \
            for (int64_t j = lo; j < hi; j++) {                                             \
                scores[i][j] = EXP(scores[i][j] - block_max);                               \
                block_sum += scores[i][j];                                                  \
            }                                                                               \
            l[i] = l[i] * correction + block_sum;                                           \
            m[i] = block_max;                                                               \
            _Pragma("omp simd")                                                             \
            for (int64_t d = 0; d < head_dim_v; d++) acc[i][d] *= correction;               \
        }                                                                                   \
        for (int64_t j = lo; j < hi; j++) {                                                 \
            for (int64_t kv = 0, i = 0; kv < num_item_heads; kv++) {                        \
                const T *vr = vb + j * v_row_stride + kv * head_dim_v;                      \
                for (int64_t g = 0; g < group; g++, i++) {                                  \
                    const ACC p = scores[i][j];                                             \
                    _Pragma("omp simd")                                                     \
                    for (int64_t d = 0; d < head_dim_v; d++) acc[i][d] += p * LOAD(vr[d]);  \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    for (int64_t i = 0; i < n; i++) {                                                       \
        T *oh = out + (query_row * num_heads + h0 * group + i) * head_dim_v;                \
        const ACC inv = l[i] > 0 ? 1 / l[i] : 0;                                            \
        for (int64_t d = 0; d < head_dim_v; d++) oh[d] = STORE(acc[i][d] * inv);            \
    }                                                                                       \
}

/* ---- The vector item: float32 and bfloat16 caches whose key and value head sizes are
 * multiples of VL (cpu_common.h), attending the same as DEFINE_ITEM's, with explicit
 * vectors where the scalar loops above leave the compiler one horizontal sum per key:
 * - scores: VL consecutive keys at a time for one query row, each key's products
 *   summed down a vector over D, the VL vectors then summed across lanes together
 *   (sum_each), which leaves the VL scores in one vector;
 * - the softmax on those vectors (masking keys outside [lo, hi) to -inf);
 * - values: COLS vectors of columns for VROWS rows of a KV head at a time, their
 *   accumulators in registers over the block's keys (4 x 2 of AVX2's 16 registers).
 * The next block is prefetched into L2 while this one is computed, a few lines at a
 * time between the multiply-adds that read this block: each value row's lines as the
 * same row of this block is summed, each key row's as a step of a score's dot product
 * (one row per step where there are at least VL steps, D >= VL * VL; else each KV
 * head's keys at once before its scores). Blocks lie anywhere in memory, so the
 * hardware prefetchers cannot run ahead across them; software prefetches issued in
 * one burst per block, or two blocks ahead, leave the loads that follow waiting on
 * them (bench/bench_kernels.py --cpu times the decode step). */
#define COLS 4

/* Prefetch into L2 the bytes [0, size) from start, a 64-byte line at a time (the rows
 * and column runs prefetched start on a line; size a compile-time constant here). */
static inline __attribute__((always_inline)) void prefetch_lines(const char *start, const int64_t size) {
    for (int64_t byte = 0; byte < size; byte += 64) __builtin_prefetch(start + byte, 0, 1);
}

/* Scores of keys key0 .. key0 + num_keys - 1 (element index of the first one's head,
 * rows row_stride apart) for one scaled query row: lane j holds key j's, 0 past
 * num_keys (those keys are not read). */
static inline __attribute__((always_inline)) vf key_scores(
    const float *query, const void *k_cache, int64_t key0, int64_t row_stride, const int num_keys,
    const int64_t D, const int bf16, const char *prefetch, int64_t prefetch_row_bytes)
{
    vf a[VL];
    for (int j = 0; j < VL; j++) a[j] = splat(0.0f);
    for (int64_t d = 0; d < D; d += VL) {
        vf qd;
        memcpy(&qd, query + d, sizeof qd);
        /* prefetch (or NULL): the next block's key row of this step, one row per step (D >= VL * VL) */
        if (prefetch && d / VL < VL) prefetch_lines(prefetch + d / VL * prefetch_row_bytes, D * (bf16 ? 2 : 4));
        for (int j = 0; j < VL; j++)
            if (j < num_keys) a[j] += qd * loadv(k_cache, key0 + j * row_stride + d, bf16);
    }
    return sum_each(a);
}

#if DOT_BF16
/* Bfloat16 caches whose key head size is a multiple of 2 VL score keys by the
 * dot-product instruction (DOT_BF16, cpu_common.h) with no widening of the keys; the
 * query stays bfloat16 and the scale multiplies the sums (torch's bfloat16 attention
 * scales the float32 product too). */
static inline __attribute__((always_inline)) vf key_scores_dot_bf16(
    const uint16_t *query, const void *k_cache, int64_t key0, int64_t row_stride, const int num_keys,
    const int64_t D, float scale, const char *prefetch, int64_t prefetch_row_bytes)
{
    vf a[VL];
    for (int j = 0; j < VL; j++) a[j] = splat(0.0f);
    for (int64_t d = 0; d < D; d += 2 * VL) {
        const vf qd = (vf)_mm512_loadu_si512(query + d);
        /* prefetch (or NULL): the next block's key rows, two per step (D >= VL * VL) */
        for (int64_t r = d / VL; prefetch && r < d / VL + 2 && r < VL; r++)
            prefetch_lines(prefetch + r * prefetch_row_bytes, D * 2);
        for (int j = 0; j < VL; j++)
            if (j < num_keys)
                a[j] = dot_bf16(a[j], qd, (vf)_mm512_loadu_si512((const uint16_t *)k_cache + key0 + j * row_stride + d));
    }
    return sum_each(a) * scale;
}
#endif

/* acc[rows][c .. c + cols - 1] += sum over keys j in lo .. hi - 1 of p[row][j] * value
 * row j's columns, for `rows` consecutive query rows of one KV head; with prefetch
 * (else NULL), the same columns of the next block's row j are prefetched beside row j. */
static inline __attribute__((always_inline)) void add_values(
    vf *acc, int64_t acc_stride, const float *p, int64_t p_stride, const void *v_cache, int64_t value0,
    int64_t v_row_stride, int64_t lo, int64_t hi, const int rows, const int cols, const int bf16,
    const char *prefetch, int64_t prefetch_row_bytes)
{
    vf a[2][COLS];
    for (int b = 0; b < rows; b++)
        for (int d = 0; d < cols; d++) a[b][d] = acc[b * acc_stride + d];
    for (int64_t j = lo; j < hi; j++) {
        vf v[COLS];
        if (prefetch) prefetch_lines(prefetch + j * prefetch_row_bytes, cols * VL * (bf16 ? 2 : 4));
        for (int d = 0; d < cols; d++) v[d] = loadv(v_cache, value0 + j * v_row_stride + VL * d, bf16);
        for (int b = 0; b < rows; b++) {
            const float pj = p[b * p_stride + j];
            for (int d = 0; d < cols; d++) a[b][d] += pj * v[d];
        }
    }
    for (int b = 0; b < rows; b++)
        for (int d = 0; d < cols; d++) acc[b * acc_stride + d] = a[b][d];
}

static inline void prefetch_rows(const char *first, int64_t rows, int64_t row_bytes, int64_t run_bytes) {
    for (int64_t j = 0; j < rows; j++)
        for (int64_t byte = 0; byte < run_bytes; byte += 64) __builtin_prefetch(first + j * row_bytes + byte, 0, 1);
}

static inline __attribute__((always_inline)) void vector_item(
    const void *q, int64_t q_stride_t, int64_t q_stride_h, const void *k_cache, const void *v_cache,
    const int32_t *table, int64_t seq_len, int64_t query_row, void *out, int64_t h0, int64_t num_item_heads,
    int64_t group, int64_t num_heads, int64_t row_stride, int64_t v_row_stride, const int64_t D, const int64_t Dv,
    int64_t block_size, float scale, int64_t window, float softcap, const double *sinks, const double *alibi,
    int64_t chunk, const int bf16)
{
    /* Rows i = 0 .. n-1 are the item's query heads h0 * group + i; row i reads KV head h0 + i / group. */
    const int64_t n = num_item_heads * group, DV = Dv / VL, query_pos = seq_len - 1;
    const int64_t element = bf16 ? 2 : 4;
    int64_t first = (window > 0 && seq_len > window) ? seq_len - window : 0;
    if (chunk > 0 && query_pos - query_pos % chunk > first) first = query_pos - query_pos % chunk;
    float qs[MAX_ITEM_HEADS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    /* The queries as they are (bfloat16), for the dot-product instruction (DOT_BF16). */
    const int dot_bf16 = DOT_BF16 && bf16 && D % (2 * VL) == 0;
    uint16_t q16[DOT_BF16 ? MAX_ITEM_HEADS : 1][MAX_HEAD_DIM] __attribute__((aligned(64)));
    vf acc[MAX_ITEM_HEADS][MAX_HEAD_DIM / VL];
    float m[MAX_ITEM_HEADS], l[MAX_ITEM_HEADS];
    /* The block's scores, then its probabilities, by key (room for a last partial vector). */
    float p[MAX_ITEM_HEADS][MAX_BLOCK + VL] __attribute__((aligned(64)));
    for (int64_t i = 0; i < n; i++) {
        const int64_t qh = query_row * q_stride_t + (h0 * group + i) * q_stride_h;
        if (dot_bf16)
            memcpy(q16[i], (const uint16_t *)q + qh, D * sizeof(uint16_t));
        else
            for (int64_t d = 0; d < D; d++) qs[i][d] = load1(q, qh + d, bf16) * scale;
        for (int64_t d = 0; d < DV; d++) acc[i][d] = splat(0.0f);
        m[i] = sinks ? (float)sinks[h0 * group + i] : -INFINITY;
        l[i] = sinks ? 1.0f : 0.0f;
    }
    const int vrows = group % 2 == 0 ? 2 : 1;  /* query rows per value pass */
    for (int64_t start = first - first % block_size; start < seq_len; start += block_size) {
        const int64_t block = table[start / block_size];
        const int64_t lo = start < first ? first - start : 0;
        const int64_t hi = seq_len - start < block_size ? seq_len - start : block_size;
        const int64_t c0 = lo - lo % VL;  /* the first vector of keys; lanes before lo are masked */
        const int64_t keys = block * block_size * row_stride + h0 * D;
        const int64_t values = block * block_size * v_row_stride + h0 * Dv;
        /* The next block's keys and values of the item's heads (NULL after the last block). */
        const int64_t next = start + block_size < seq_len ? table[start / block_size + 1] : -1;
        const char *next_k = next < 0 ? NULL : (const char *)k_cache + (next * block_size * row_stride + h0 * D) * element;
        const char *next_v = next < 0 ? NULL : (const char *)v_cache + (next * block_size * v_row_stride + h0 * Dv) * element;
        const int spread_keys = D >= VL * VL;  /* a step of the dot product per key row to prefetch */
        for (int64_t kv = 0; kv < num_item_heads; kv++) {
            if (next_k && !spread_keys) prefetch_rows(next_k + kv * D * element, block_size, row_stride * element, D * element);
            for (int64_t j0 = c0; j0 < hi; j0 += VL) {
                const int64_t key0 = keys + j0 * row_stride + kv * D;
                for (int64_t i = kv * group; i < (kv + 1) * group; i++) {
                    /* the first query row of the head prefetches the next block's rows j0 .. j0 + VL - 1 */
                    const char *fetch = next_k && spread_keys && i == kv * group
                        ? next_k + (j0 * row_stride + kv * D) * element : NULL;
                    const int num_keys = hi - j0 >= VL ? VL : (int)(hi - j0);
#if DOT_BF16
                    const vf s = dot_bf16
                        ? (num_keys == VL
                           ? key_scores_dot_bf16(q16[i], k_cache, key0, row_stride, VL, D, scale, fetch,
                                                 row_stride * element)
                           : key_scores_dot_bf16(q16[i], k_cache, key0, row_stride, num_keys, D, scale, fetch,
                                                 row_stride * element))
                        : num_keys == VL
                        ? key_scores(qs[i], k_cache, key0, row_stride, VL, D, bf16, fetch, row_stride * element)
                        : key_scores(qs[i], k_cache, key0, row_stride, num_keys, D, bf16, fetch,
                                     row_stride * element);
#else
                    const vf s = num_keys == VL
                        ? key_scores(qs[i], k_cache, key0, row_stride, VL, D, bf16, fetch, row_stride * element)
                        : key_scores(qs[i], k_cache, key0, row_stride, num_keys, D, bf16, fetch,
                                     row_stride * element);
#endif
                    memcpy(&p[i][j0], &s, sizeof s);
                }
            }
        }
        for (int64_t i = 0; i < n; i++) {
            const float slope = alibi ? (float)alibi[h0 * group + i] : 0.0f;
            vf block_max = splat(-INFINITY);
            for (int64_t j0 = c0; j0 < hi; j0 += VL) {
                const vf j = (vf)LANE_INDICES + (float)j0;
                vf s;
                memcpy(&s, &p[i][j0], sizeof s);
                if (alibi) s += slope * (j + (float)(start - query_pos));
                if (softcap > 0) s = softcap * vtanh(s * (1.0f / softcap));
                s = blend((j < (float)lo) | (j >= (float)hi), splat(-INFINITY), s);
                memcpy(&p[i][j0], &s, sizeof s);
                block_max = vmax(block_max, s);
            }
            const float new_max = hmax(block_max) > m[i] ? hmax(block_max) : m[i];
            const float correction = exp_f32(m[i] - new_max);
            vf sum = splat(0.0f);
            for (int64_t j0 = c0; j0 < hi; j0 += VL) {
                vf s;
                memcpy(&s, &p[i][j0], sizeof s);
                s = vexp(s - new_max);  /* masked keys: exactly 0 */
                memcpy(&p[i][j0], &s, sizeof s);
                sum += s;
            }
            l[i] = l[i] * correction + hsum(sum);
            m[i] = new_max;
            if (correction != 1.0f)
                for (int64_t d = 0; d < DV; d++) acc[i][d] *= correction;
        }
        for (int64_t kv = 0; kv < num_item_heads; kv++)
            for (int64_t i = kv * group; i < (kv + 1) * group; i += vrows)
                for (int64_t c = 0; c < DV; c += DV % COLS == 0 ? COLS : 1) {
                    const int64_t value0 = values + kv * Dv + VL * c;
                    /* the first rows of the head prefetch these columns of the next block's values */
                    const char *fetch = next_v && i == kv * group ? next_v + (kv * Dv + VL * c) * element : NULL;
                    if (DV % COLS == 0 && vrows == 2)
                        add_values(&acc[i][c], MAX_HEAD_DIM / VL, p[i], MAX_BLOCK + VL, v_cache, value0,
                                   v_row_stride, lo, hi, 2, COLS, bf16, fetch, v_row_stride * element);
                    else if (DV % COLS == 0)
                        add_values(&acc[i][c], MAX_HEAD_DIM / VL, p[i], MAX_BLOCK + VL, v_cache, value0,
                                   v_row_stride, lo, hi, 1, COLS, bf16, fetch, v_row_stride * element);
                    else
                        for (int64_t b = 0; b < vrows; b++)
                            add_values(&acc[i + b][c], MAX_HEAD_DIM / VL, p[i + b], MAX_BLOCK + VL, v_cache,
                                       value0, v_row_stride, lo, hi, 1, 1, bf16, b == 0 ? fetch : NULL,
                                       v_row_stride * element);
                }
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t o = (query_row * num_heads + h0 * group + i) * Dv;
        const float inverse = l[i] > 0 ? 1.0f / l[i] : 0.0f;
        for (int64_t d = 0; d < DV; d++) storev(out, o + VL * d, acc[i][d] * inverse, bf16);
    }
}

/* Head sizes 64 and 128 take the chunked item (cpu_decode_chunked.h): float32 on every
 * build, bfloat16 on 8-lane ones and, on 16-lane ones, past blocks of
 * VECTOR_BF16_MAX_BLOCK keys. 16-lane builds read bfloat16 blocks of up to 16 keys as
 * fast through the vector item, whose scores use the dot-product instruction where the
 * target has it; its per-block softmax and its burst of prefetches per block grow with
 * the block, and it falls behind the chunked item past that size.
 * Both items read a call's rows from memory in a decode step, which reads every
 * layer's weights between two calls of one layer; where a small call's rows are in
 * L2 instead (a benchmark repeating one call), the chunked item runs slower than the
 * vector one on 8-lane builds (its value pass loads and stores its accumulators at
 * every key), but faster from memory: the item does not change with the call. */
#include "cpu_decode_chunked.h"
#define CHUNKED_ITEM(BF16, SIZE, ...) \
    ((BF16) ? chunked_item_##SIZE##_bf16(__VA_ARGS__) : chunked_item_##SIZE##_f32(__VA_ARGS__))
#define VECTOR_BF16_MAX_BLOCK 16
#define TAKES_CHUNKED(BF16, BLOCK_SIZE) (!(BF16) || VL == 8 || (BLOCK_SIZE) > VECTOR_BF16_MAX_BLOCK)
/* A call reading at most this many bytes of keys and values counts as `cached` (the
 * chunked item then makes no L2 prefetches): half of the 2 MiB L2 of current x86
 * server cores, so its rows can all be there. */
#define CACHED_CALL_BYTES (1 << 20)

/* The vector item for one element type, as its own function (its work arrays in their
 * own stack frame), with the common head sizes as constants. */
#define DEFINE_VECTOR_ITEM(NAME, BF16)                                                          \
static __attribute__((noinline)) void NAME(                                                     \
    const void *q, int64_t q_stride_t, int64_t q_stride_h, const void *k_cache, const void *v_cache, \
    const int32_t *table, int64_t seq_len, int64_t query_row, void *out, int64_t h0,             \
    int64_t num_item_heads, int64_t group, int64_t num_heads, int64_t row_stride,                \
    int64_t v_row_stride, int64_t head_dim, int64_t head_dim_v, int64_t block_size, float scale, \
    int64_t window, float softcap, const double *sinks, const double *alibi, int64_t chunk,      \
    int cached)                                                                                 \
{                                                                                               \
    if (TAKES_CHUNKED(BF16, block_size) && head_dim == head_dim_v && (head_dim == 64 || head_dim == 128)) { \
        if (head_dim == 64)                                                                     \
            CHUNKED_ITEM(BF16, 64, q, q_stride_t, q_stride_h, k_cache, v_cache, table, seq_len, query_row, \
                         out, h0, num_item_heads, group, num_heads, row_stride, block_size, scale, \
                         window, softcap, sinks, alibi, chunk, cached);                         \
        else                                                                                    \
            CHUNKED_ITEM(BF16, 128, q, q_stride_t, q_stride_h, k_cache, v_cache, table, seq_len, query_row, \
                         out, h0, num_item_heads, group, num_heads, row_stride, block_size, scale, \
                         window, softcap, sinks, alibi, chunk, cached);                         \
    }                                                                                           \
    else if (head_dim == head_dim_v && head_dim == 64)                                          \
        vector_item(q, q_stride_t, q_stride_h, k_cache, v_cache, table, seq_len, query_row, out, h0, \
                    num_item_heads, group, num_heads, row_stride, v_row_stride, 64, 64, block_size, \
                    scale, window, softcap, sinks, alibi, chunk, BF16);                         \
    else if (head_dim == head_dim_v && head_dim == 128)                                         \
        vector_item(q, q_stride_t, q_stride_h, k_cache, v_cache, table, seq_len, query_row, out, h0, \
                    num_item_heads, group, num_heads, row_stride, v_row_stride, 128, 128, block_size, \
                    scale, window, softcap, sinks, alibi, chunk, BF16);                         \
    else                                                                                        \
        vector_item(q, q_stride_t, q_stride_h, k_cache, v_cache, table, seq_len, query_row, out, h0, \
                    num_item_heads, group, num_heads, row_stride, v_row_stride, head_dim, head_dim_v, \
                    block_size, scale, window, softcap, sinks, alibi, chunk, BF16);             \
}

DEFINE_VECTOR_ITEM(vector_item_f32, 0)
DEFINE_VECTOR_ITEM(vector_item_bf16, 1)

#define DEFINE_DECODE(NAME, ITEM, T, ACC, VECTOR, VECTORIZED)                               \
void NAME(const T *q, int64_t q_stride_t, int64_t q_stride_h,                               \
          const T *k_cache, const T *v_cache,                                               \
          const int32_t *block_tables, int64_t table_stride,                                \
          const int64_t *seq_lens, const int64_t *query_rows,                               \
          const int64_t *requests, int64_t num_requests,                                    \
          T *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,                \
          int64_t head_dim_v, int64_t block_size, double scale, int64_t window,             \
          double softcap, const double *sinks, const double *alibi, int64_t chunk,          \
          int num_threads)                                                                  \
{                                                                                           \
    const int64_t group = num_heads / num_kv_heads;                                         \
    const int64_t row_stride = num_kv_heads * head_dim; /* one token in a block */          \
    const int64_t v_row_stride = num_kv_heads * head_dim_v;                                 \
    /* KV heads per item: all of them (each key row read as one contiguous run), split      \
     * while there are too few items to keep every thread busy or too many heads. */        \
    int64_t item_heads = num_kv_heads;                                                      \
    while (item_heads > 1 && (item_heads * group > MAX_ITEM_HEADS                           \
                              || num_requests * (num_kv_heads / item_heads) < 4 * num_threads)) { \
        int64_t smaller = item_heads - 1; /* the next divisor of num_kv_heads down */       \
        while (num_kv_heads % smaller) smaller--;                                           \
        item_heads = smaller;                                                               \
    }                                                                                       \
    const int64_t items_per_request = num_kv_heads / item_heads;                            \
    int64_t call_rows = 0;  /* key rows the call reads, at most */                          \
    for (int64_t r = 0; r < num_requests; r++) call_rows += seq_lens[requests[r]];          \
    const int cached = call_rows * (row_stride + v_row_stride) * (int64_t)sizeof(T) <= CACHED_CALL_BYTES; \
    const int64_t num_items = num_requests * items_per_request;                             \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")               \
    for (int64_t item = 0; item < num_items; item++) {                                      \
        const int64_t b = requests[item / items_per_request];                               \
        const int64_t h0 = (item % items_per_request) * item_heads;                         \
        const int32_t *table = block_tables + b * table_stride;                             \
        if (VECTORIZED && head_dim % VL == 0 && head_dim_v % VL == 0) {                     \
            VECTOR(q, q_stride_t, q_stride_h, k_cache, v_cache, table, seq_lens[b], query_rows[b], \
                   out, h0, item_heads, group, num_heads, row_stride, v_row_stride, head_dim,   \
                   head_dim_v, block_size, (float)scale, window, (float)softcap, sinks, alibi, chunk, \
                   cached);                                                                 \
            continue;                                                                       \
        }                                                                                   \
        /* A constant head size lets the compiler unroll the inner loops. */                \
        const int64_t size = head_dim == head_dim_v && (head_dim == 64 || head_dim == 128) ? head_dim : 0; \
        if (size == 64)                                                                     \
            ITEM(q, q_stride_t, q_stride_h, k_cache, v_cache, table, seq_lens[b], query_rows[b], \
                 out, h0, item_heads, group, num_heads, row_stride, v_row_stride, 64, 64,   \
                 block_size, (ACC)scale, window, (ACC)softcap, sinks, alibi, chunk);        \
        else if (size == 128)                                                               \
            ITEM(q, q_stride_t, q_stride_h, k_cache, v_cache, table, seq_lens[b], query_rows[b], \
                 out, h0, item_heads, group, num_heads, row_stride, v_row_stride, 128, 128, \
                 block_size, (ACC)scale, window, (ACC)softcap, sinks, alibi, chunk);        \
        else                                                                                \
            ITEM(q, q_stride_t, q_stride_h, k_cache, v_cache, table, seq_lens[b], query_rows[b], \
                 out, h0, item_heads, group, num_heads, row_stride, v_row_stride, head_dim, \
                 head_dim_v, block_size, (ACC)scale, window, (ACC)softcap, sinks, alibi, chunk); \
    }                                                                                       \
}

DEFINE_ITEM(item_f32, float, float, exp_f32, tanhf, same_f32, same_f32)
DEFINE_ITEM(item_f64, double, double, exp, tanh, same_f64, same_f64)
DEFINE_ITEM(item_bf16, uint16_t, float, exp_f32, tanhf, bf16_to_f32, f32_to_bf16)
DEFINE_DECODE(decode_attention_f32, item_f32, float, float, vector_item_f32, 1)
DEFINE_DECODE(decode_attention_f64, item_f64, double, double, vector_item_f32, 0)
DEFINE_DECODE(decode_attention_bf16, item_bf16, uint16_t, float, vector_item_bf16, 1)

/* Limits the launcher checks before calling (the work arrays live on the stack). */
int64_t decode_attention_max_group(void) { return MAX_GROUP; }
int64_t decode_attention_max_head_dim(void) { return MAX_HEAD_DIM; }
int64_t decode_attention_max_block(void) { return MAX_BLOCK; }
