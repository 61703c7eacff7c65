/* Absorbed multi-head latent attention decode for the CPU path: one query token per
 * request, read straight out of the paged latent cache through the block tables.
 *
 * A latent layer's cache row per token is [c, k_rope] (kv_lora_rank r latent numbers,
 * then the rotary key), shared by every head. With the query absorbed by the caller
 * (q_abs = [q_nope W_UK, q_rope], W = r + dr numbers per head), a head's score is
 * q_abs . row over the whole row and its value is the row's first r numbers: multi-query
 * attention whose value is a prefix of its key. The kernel returns each head's
 * softmax-weighted sum of latents (out [n, H, r]); the caller applies W_UV.
 *
 * Work item = (request, a run of heads): each item reads every context row once and
 * scores it against its heads; an online softmax over one block of keys at a time
 * (running max m, running sum l, accumulator acc, rescaled by exp(m_old - m_new) when
 * the max grows). Items run in parallel (OpenMP, dynamic schedule: contexts differ in
 * length); fewer heads per item when the threads would otherwise idle.
 *
 * float32 and bfloat16 caches go through the vector item (below DEFINE_ITEM): a run is
 * up to 2 x VL heads (cpu_common.h: VL 16 with AVX-512, else 8), one per vector lane, so scores,
 * softmax and sums are whole-vector multiply-adds for the build's target (kernels/
 * native.py: AVX-512, AVX2, or the baseline's SSE2); float64 goes through DEFINE_ITEM's
 * `omp simd` loops, runs of up to MAX_GROUP heads.
 *
 * float32, float64 and bfloat16 caches; bfloat16 is read into float32 and accumulates
 * there.
 *
 * Layouts (asserted by the Python launcher, kernels/cpu_mla.py):
 *   q:            [n, H, W] contiguous (absorbed queries, one row per request)
 *   cache:        [num_blocks, block_size, W] contiguous
 *   block_tables: [n, table_stride] int32
 *   seq_lens:     [n] int64: context length including the new token
 *   out:          [n, H, r] contiguous
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#define MAX_GROUP 16
#define MAX_WIDTH 1024
#define MAX_BLOCK 128

#define DEFINE_ITEM(NAME, T, ACC, EXP, LOAD, STORE)                                          \
static void NAME(const T *q, const T *cache, const int32_t *table, int64_t seq_len, T *out,   \
                 int64_t h0, int64_t heads, int64_t width, int64_t rank, int64_t block_size,  \
                 ACC scale)                                                                   \
{                                                                                             \
    ACC qs[MAX_GROUP][MAX_WIDTH];                                                             \
    ACC acc[MAX_GROUP][MAX_WIDTH];                                                            \
    ACC m[MAX_GROUP], l[MAX_GROUP];                                                           \
    ACC scores[MAX_GROUP][MAX_BLOCK];                                                         \
    ACC row[MAX_WIDTH];                                                                       \
    for (int64_t g = 0; g < heads; g++) {                                                     \
        const T *qh = q + (h0 + g) * width;                                                   \
        for (int64_t d = 0; d < width; d++) qs[g][d] = LOAD(qh[d]) * scale;                   \
        for (int64_t d = 0; d < rank; d++) acc[g][d] = 0;                                     \
        m[g] = -INFINITY;                                                                     \
        l[g] = 0;                                                                             \
    }                                                                                         \
    for (int64_t start = 0; start < seq_len; start += block_size) {                           \
        const T *rows = cache + (int64_t)table[start / block_size] * block_size * width;      \
        const int64_t keys = seq_len - start < block_size ? seq_len - start : block_size;     \
        for (int64_t j = 0; j < keys; j++) {                                                  \
            const T *r = rows + j * width;                                                    \
            _Pragma("omp simd")                                                               \
            for (int64_t d = 0; d < width; d++) row[d] = LOAD(r[d]);                          \
            for (int64_t g = 0; g < heads; g++) {                                             \
                ACC s = 0;                                                                    \
                _Pragma("omp simd reduction(+:s)")                                            \
                for (int64_t d = 0; d < width; d++) s += qs[g][d] * row[d];                   \
                scores[g][j] = s;                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int64_t g = 0; g < heads; g++) {                                                 \
            ACC block_max = m[g];                                                             \
            for (int64_t j = 0; j < keys; j++) block_max = scores[g][j] > block_max ? scores[g][j] : block_max; \
            const ACC correction = EXP(m[g] - block_max);                                     \
            ACC block_sum = 0;                                                                \
            for (int64_t j = 0; j < keys; j++) {                                              \
                scores[g][j] = EXP(scores[g][j] - block_max);                                 \
                block_sum += scores[g][j];                                                    \
            }                                                                                 \
            l[g] = l[g] * correction + block_sum;                                             \
            m[g] = block_max;                                                                 \
            _Pragma("omp simd")                                                               \
            for (int64_t d = 0; d < rank; d++) acc[g][d] *= correction;                       \
        }                                                                                     \
        for (int64_t j = 0; j < keys; j++) {                                                  \
            const T *r = rows + j * width;                                                    \
            _Pragma("omp simd")                                                               \
            for (int64_t d = 0; d < rank; d++) row[d] = LOAD(r[d]);                           \
            for (int64_t g = 0; g < heads; g++) {                                             \
                const ACC p = scores[g][j];                                                   \
                _Pragma("omp simd")                                                           \
                for (int64_t d = 0; d < rank; d++) acc[g][d] += p * row[d];                   \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int64_t g = 0; g < heads; g++) {                                                     \
        T *oh = out + (h0 + g) * rank;                                                        \
        const ACC inv = l[g] > 0 ? 1 / l[g] : 0;                                              \
        for (int64_t d = 0; d < rank; d++) oh[d] = STORE(acc[g][d] * inv);                    \
    }                                                                                         \
}


/* ---- The vector item (float32 and bfloat16 caches): the item's heads are the lanes of
 * NV vectors (up to NV * VL heads, cpu_common.h's VL; NV is 2 where the item has more
 * than VL heads), so every step is a multiply-add of whole vectors with no horizontal
 * sum: a key's scores are sum_d q^T[d] * row[d] (the scaled queries held transposed,
 * NV vectors per column d, times each row number broadcast), four keys at a time
 * sharing each q^T[d] load; the online softmax runs on the score vectors (vexp); the
 * latent sums acc^T[d] += p[j] * row_j[d], four columns at a time over the block's
 * keys, kept in registers. Each broadcast row number feeds NV multiply-adds. Heads
 * past `heads` hold zero queries and are not stored. */
#define KEYS 4
#define MAX_NV 2

static inline __attribute__((always_inline)) vf bcast(const void *row, int64_t d, const int bf16) {
    return splat(load1(row, d, bf16));
}

/* Scores of keys j .. j + KEYS - 1 of a block (rows width apart, from rows) into s. */
static inline __attribute__((always_inline)) void score_keys(
    vf (*qt)[MAX_NV], const void *rows, int64_t j, int64_t width, const int bf16, vf (*s)[MAX_NV], const int nv)
{
    vf a[KEYS][MAX_NV];
    for (int k = 0; k < KEYS; k++)
        for (int v = 0; v < nv; v++) a[k][v] = splat(0.0f);
    for (int64_t d = 0; d < width; d++) {
        for (int k = 0; k < KEYS; k++) {
            const vf r = bcast(rows, (j + k) * width + d, bf16);
            for (int v = 0; v < nv; v++) a[k][v] += qt[d][v] * r;
        }
    }
    for (int k = 0; k < KEYS; k++)
        for (int v = 0; v < nv; v++) s[j + k][v] = a[k][v];
}

/* acc[d .. d + cols - 1] = acc * correction + sum over the block's keys of p[j] * row_j. */
static inline __attribute__((always_inline)) void add_latents(
    vf (*acc)[MAX_NV], const vf *correction, vf (*s)[MAX_NV], const void *rows, int64_t keys, int64_t d,
    int64_t width, const int cols, const int bf16, const int nv)
{
    vf a[KEYS][MAX_NV];
    for (int k = 0; k < cols; k++)
        for (int v = 0; v < nv; v++) a[k][v] = acc[d + k][v] * correction[v];
    for (int64_t j = 0; j < keys; j++)
        for (int k = 0; k < cols; k++) {
            const vf r = bcast(rows, j * width + d + k, bf16);
            for (int v = 0; v < nv; v++) a[k][v] += s[j][v] * r;
        }
    for (int k = 0; k < cols; k++)
        for (int v = 0; v < nv; v++) acc[d + k][v] = a[k][v];
}

static inline __attribute__((always_inline)) void vector_item(
    const void *q, const void *cache, const int32_t *table, int64_t seq_len, void *out, int64_t h0,
    int64_t heads, int64_t width, int64_t rank, int64_t block_size, float scale, const int bf16, const int nv)
{
    /* Per thread, not on the stack: 280 KB at AVX-512 would crowd an OpenMP thread's stack. */
    static __thread vf qt[MAX_WIDTH][MAX_NV], acc[MAX_WIDTH][MAX_NV], s[MAX_BLOCK][MAX_NV];
    for (int64_t d = 0; d < width; d++)
        for (int v = 0; v < nv; v++) {
            qt[d][v] = splat(0.0f);
            for (int64_t g = v * VL; g < heads && g < (v + 1) * VL; g++)
                qt[d][v][g - v * VL] = load1(q, (h0 + g) * width + d, bf16) * scale;
        }
    for (int64_t d = 0; d < rank; d++)
        for (int v = 0; v < nv; v++) acc[d][v] = splat(0.0f);
    vf m[MAX_NV], l[MAX_NV], correction[MAX_NV];
    for (int v = 0; v < nv; v++) m[v] = splat(-INFINITY), l[v] = splat(0.0f);
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const char *rows = (const char *)cache + (int64_t)table[start / block_size] * block_size * width * elem;
        const int64_t keys = seq_len - start < block_size ? seq_len - start : block_size;
        int64_t j = 0;
        for (; j + KEYS <= keys; j += KEYS) score_keys(qt, rows, j, width, bf16, s, nv);
        for (; j < keys; j++)
            for (int v = 0; v < nv; v++) {
                vf a = splat(0.0f);
                for (int64_t d = 0; d < width; d++) a += qt[d][v] * bcast(rows, j * width + d, bf16);
                s[j][v] = a;
            }
        for (int v = 0; v < nv; v++) {
            vf block_max = m[v];
            for (j = 0; j < keys; j++) block_max = vmax(block_max, s[j][v]);
            correction[v] = vexp(m[v] - block_max);
            vf block_sum = splat(0.0f);
            for (j = 0; j < keys; j++) {
                s[j][v] = vexp(s[j][v] - block_max);
                block_sum += s[j][v];
            }
            l[v] = l[v] * correction[v] + block_sum;
            m[v] = block_max;
        }
        int64_t d = 0;
        for (; d + KEYS <= rank; d += KEYS) add_latents(acc, correction, s, rows, keys, d, width, KEYS, bf16, nv);
        for (; d < rank; d++) add_latents(acc, correction, s, rows, keys, d, width, 1, bf16, nv);
    }
    for (int64_t g = 0; g < heads; g++) {
        const int v = (int)(g / VL), lane = (int)(g % VL);
        const float inv = l[v][lane] > 0 ? 1 / l[v][lane] : 0;
        for (int64_t d = 0; d < rank; d++) {
            const float value = acc[d][v][lane] * inv;
            if (bf16) ((uint16_t *)out)[(h0 + g) * rank + d] = f32_to_bf16(value);
            else ((float *)out)[(h0 + g) * rank + d] = value;
        }
    }
}

/* One instance per element type and vector count (NV = 2 past VL heads). */
static __attribute__((noinline)) void vector_item_f32(const float *q, const float *cache, const int32_t *table,
    int64_t seq_len, float *out, int64_t h0, int64_t heads, int64_t width, int64_t rank, int64_t block_size,
    float scale) {
    if (heads > VL) vector_item(q, cache, table, seq_len, out, h0, heads, width, rank, block_size, scale, 0, 2);
    else vector_item(q, cache, table, seq_len, out, h0, heads, width, rank, block_size, scale, 0, 1);
}
static __attribute__((noinline)) void vector_item_bf16(const uint16_t *q, const uint16_t *cache,
    const int32_t *table, int64_t seq_len, uint16_t *out, int64_t h0, int64_t heads, int64_t width, int64_t rank,
    int64_t block_size, float scale) {
    if (heads > VL) vector_item(q, cache, table, seq_len, out, h0, heads, width, rank, block_size, scale, 1, 2);
    else vector_item(q, cache, table, seq_len, out, h0, heads, width, rank, block_size, scale, 1, 1);
}

#define DEFINE_DECODE(NAME, ITEM, T, ACC, GROUP)                                                     \
void NAME(const T *q, const T *cache, const int32_t *block_tables, int64_t table_stride,     \
          const int64_t *seq_lens, int64_t num_requests, T *out, int64_t num_heads,           \
          int64_t width, int64_t rank, int64_t block_size, double scale, int num_threads)     \
{                                                                                             \
    int64_t per_item = num_heads < GROUP ? num_heads : GROUP;                                 \
    while (per_item > 1 && num_requests * ((num_heads + per_item - 1) / per_item) < num_threads) \
        per_item = (per_item + 1) / 2;                                                        \
    const int64_t runs = (num_heads + per_item - 1) / per_item;                               \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                 \
    for (int64_t item = 0; item < num_requests * runs; item++) {                              \
        const int64_t b = item / runs, h0 = item % runs * per_item;                           \
        const int64_t heads = num_heads - h0 < per_item ? num_heads - h0 : per_item;          \
        ITEM(q + b * num_heads * width, cache, block_tables + b * table_stride, seq_lens[b],  \
             out + b * num_heads * rank, h0, heads, width, rank, block_size, (ACC)scale);     \
    }                                                                                         \
}

DEFINE_ITEM(item_f64, double, double, exp, same_f64, same_f64)
DEFINE_DECODE(mla_decode_f32, vector_item_f32, float, float, MAX_NV * VL)
DEFINE_DECODE(mla_decode_f64, item_f64, double, double, MAX_GROUP)
DEFINE_DECODE(mla_decode_bf16, vector_item_bf16, uint16_t, float, MAX_NV * VL)

int64_t mla_decode_max_width(void) { return MAX_WIDTH; }
int64_t mla_decode_max_block(void) { return MAX_BLOCK; }
