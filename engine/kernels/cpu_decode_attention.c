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
 * accumulates there, which halves the bytes a decode step reads.
 *
 * Common head sizes get their own instance with the head size a compile-time
 * constant, so the compiler unrolls and vectorizes the dot products and the
 * accumulation; float32 exponentials use a vectorizable polynomial (below).
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

#define DEFINE_DECODE(NAME, ITEM, T, ACC)                                                   \
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
    const int64_t num_items = num_requests * items_per_request;                             \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")               \
    for (int64_t item = 0; item < num_items; item++) {                                      \
        const int64_t b = requests[item / items_per_request];                               \
        const int64_t h0 = (item % items_per_request) * item_heads;                         \
        const int32_t *table = block_tables + b * table_stride;                             \
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
DEFINE_DECODE(decode_attention_f32, item_f32, float, float)
DEFINE_DECODE(decode_attention_f64, item_f64, double, double)
DEFINE_DECODE(decode_attention_bf16, item_bf16, uint16_t, float)

/* Limits the launcher checks before calling (the work arrays live on the stack). */
int64_t decode_attention_max_group(void) { return MAX_GROUP; }
int64_t decode_attention_max_head_dim(void) { return MAX_HEAD_DIM; }
int64_t decode_attention_max_block(void) { return MAX_BLOCK; }
