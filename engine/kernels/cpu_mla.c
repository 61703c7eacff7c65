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
 * Work item = (request, a run of up to MAX_GROUP heads): each item reads every context
 * row once and scores it against its heads while the row is in L1; an online softmax
 * over one block of keys at a time (running max m, running sum l, accumulator acc,
 * rescaled by exp(m_old - m_new) when the max grows). Fewer heads per item when the
 * threads would otherwise idle. Items run in parallel (OpenMP, dynamic schedule:
 * contexts differ in length). The inner loops are `omp simd` loops over contiguous
 * numbers, vectorized for the build's target (kernels/native.py: AVX-512, AVX2, or the
 * baseline's SSE2 / scalar code).
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

#define DEFINE_DECODE(NAME, ITEM, T, ACC)                                                     \
void NAME(const T *q, const T *cache, const int32_t *block_tables, int64_t table_stride,     \
          const int64_t *seq_lens, int64_t num_requests, T *out, int64_t num_heads,           \
          int64_t width, int64_t rank, int64_t block_size, double scale, int num_threads)     \
{                                                                                             \
    int64_t per_item = num_heads < MAX_GROUP ? num_heads : MAX_GROUP;                         \
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

DEFINE_ITEM(item_f32, float, float, exp_f32, same_f32, same_f32)
DEFINE_ITEM(item_f64, double, double, exp, same_f64, same_f64)
DEFINE_ITEM(item_bf16, uint16_t, float, exp_f32, bf16_to_f32, f32_to_bf16)
DEFINE_DECODE(mla_decode_f32, item_f32, float, float)
DEFINE_DECODE(mla_decode_f64, item_f64, double, double)
DEFINE_DECODE(mla_decode_bf16, item_bf16, uint16_t, float)

int64_t mla_decode_max_width(void) { return MAX_WIDTH; }
int64_t mla_decode_max_block(void) { return MAX_BLOCK; }
