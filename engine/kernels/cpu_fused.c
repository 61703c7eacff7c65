/* Fused elementwise steps of a decoder layer for the CPU path, each one pass over its
 * rows where torch runs several ops (and allocates a temporary for each):
 *
 *   rms_norm:      out = weight * (x / sqrt(mean(x^2) + eps)), by rows
 *   add_rms_norm:  x += delta (the residual stream, in place), then out = rms_norm(x)
 *   silu_mul:      out = silu(gate) * up, gate and up the halves of each row of gate_up
 *   rotary:        q and k rotated in place by cos and sin ("rotate half": the pairs
 *                  are (i, i + D/2))
 *   kv_write:      a step's new keys and values copied into their paged cache slots
 *                  (bytes: any dtype), one call for both caches; kv_write_noting, the
 *                  same with the count of slots out of range noted, not returned (a
 *                  recorded decode step replays it: kernels/programs.py)
 *
 * Each computes in float32 and rounds where transformers' modules round, so bfloat16
 * results match theirs step for step: rms_norm rounds the normalized row before the
 * weight multiplies it; silu_mul rounds silu(gate) before the product; rotary rounds
 * q * cos and rotate_half(q) * sin before their sum. (float32 results agree to a few
 * ulp: sums are reduced in another order.)
 *
 * Rows are split over OpenMP threads when there are enough of them; a decode step's
 * few rows run on the calling thread, where a parallel region would cost more than
 * the work.
 *
 * Layouts (asserted by the launcher, kernels/cpu_fused.py): rows of `cols` contiguous
 * elements, `stride` elements apart; weights, cos and sin contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

/* Below this many elements a call runs on one thread. */
#define PARALLEL_MIN_ELEMENTS 65536

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

static inline float silu_f32(float x) { return x / (1.0f + exp_f32(-x)); }

/* One row of silu(gate) * up: VL lanes at a time through vexp (cpu_common.h; the
 * compiler's own vectorisation of the element loop is several times slower), the rest
 * of the row element by element. vexp differs from exp_f32 only below -87, where
 * 1 + exp(-x) is 1 either way. */
static inline void silu_mul_row_f32(const float *gate, const float *up, float *out, int64_t cols) {
    int64_t c = 0;
    for (; c + VL <= cols; c += VL) {
        vf g, u;
        memcpy(&g, gate + c, sizeof g);
        memcpy(&u, up + c, sizeof u);
        const vf product = g / (1.0f + vexp(-g)) * u;
        memcpy(out + c, &product, sizeof product);
    }
    for (; c < cols; c++) out[c] = silu_f32(gate[c]) * up[c];
}

static inline void silu_mul_row_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t cols) {
    int64_t c = 0;
    for (; c + VL <= cols; c += VL) {
        const vf g = loadv(gate, c, 1);
        storev(out, c, round_bf16_v(g / (1.0f + vexp(-g))) * loadv(up, c, 1), 1);
    }
    for (; c < cols; c++) out[c] = f32_to_bf16(round_bf16(silu_f32(bf16_to_f32(gate[c]))) * bf16_to_f32(up[c]));
}

/* bfloat16 rows VL lanes at a time (the element loops' rounding to nearest even of
 * f32_to_bf16 keeps the compiler from vectorising them): rms_norm's row, and one head
 * of the rotary step. The same roundings as the element loops, in the same places. */
static inline void rms_row_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t cols,
                                float eps) {
    vf sums = splat(0.0f);
    int64_t c = 0;
    for (; c + VL <= cols; c += VL) {
        const vf v = loadv(x, c, 1);
        sums += v * v;
    }
    float sum = hsum(sums);
    for (int64_t tail = c; tail < cols; tail++) sum += bf16_to_f32(x[tail]) * bf16_to_f32(x[tail]);
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    for (c = 0; c + VL <= cols; c += VL)
        storev(out, c, loadv(weight, c, 1) * round_bf16_v(loadv(x, c, 1) * inv), 1);
    for (; c < cols; c++) out[c] = f32_to_bf16(bf16_to_f32(weight[c]) * round_bf16(bf16_to_f32(x[c]) * inv));
}

static inline void rotate_head_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half) {
    int64_t i = 0;
    for (; i + VL <= half; i += VL) {
        const vf a = loadv(x, i, 1), b = loadv(x, i + half, 1);
        storev(x, i, round_bf16_v(a * loadv(cos, i, 1)) + round_bf16_v(-b * loadv(sin, i, 1)), 1);
        storev(x, i + half, round_bf16_v(b * loadv(cos, i + half, 1)) + round_bf16_v(a * loadv(sin, i + half, 1)), 1);
    }
    for (; i < half; i++) {
        const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
        x[i] = f32_to_bf16(round_bf16(a * bf16_to_f32(cos[i])) + round_bf16(-b * bf16_to_f32(sin[i])));
        x[i + half] = f32_to_bf16(round_bf16(b * bf16_to_f32(cos[i + half])) + round_bf16(a * bf16_to_f32(sin[i + half])));
    }
}

static inline void add_row_bf16(uint16_t *x, const uint16_t *delta, int64_t cols) {
    int64_t c = 0;
    for (; c + VL <= cols; c += VL) storev(x, c, loadv(x, c, 1) + loadv(delta, c, 1), 1);
    for (; c < cols; c++) x[c] = f32_to_bf16(bf16_to_f32(x[c]) + bf16_to_f32(delta[c]));
}

/* float32 rows: the compiler vectorises these element loops itself. */
static inline void add_row_f32(float *x, const float *delta, int64_t cols) {
    _Pragma("omp simd")
    for (int64_t c = 0; c < cols; c++) x[c] += delta[c];
}

static inline void rms_row_f32(const float *x, const float *weight, float *out, int64_t cols, float eps) {
    float sum = 0.0f;
    _Pragma("omp simd reduction(+:sum)")
    for (int64_t c = 0; c < cols; c++) sum += x[c] * x[c];
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    _Pragma("omp simd")
    for (int64_t c = 0; c < cols; c++) out[c] = weight[c] * (x[c] * inv);
}

/* One head of one token: x[i], x[i + half] -> x[i] c[i] - x[i + half] s[i],
 * x[i + half] c[i + half] + x[i] s[i + half]. */
static inline void rotate_head_f32(float *x, const float *cos, const float *sin, int64_t half) {
    _Pragma("omp simd")
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + -b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

#define DEFINE_FUSED(SUFFIX, T)                                                                   \
    void rms_norm_##SUFFIX(const T *x, int64_t x_stride, const T *weight, T *out,               \
                           int64_t out_stride, int64_t rows, int64_t cols, double eps,          \
                           int num_threads) {                                                   \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < rows; r++)                                                      \
            rms_row_##SUFFIX(x + r * x_stride, weight, out + r * out_stride, cols, (float)eps); \
    }                                                                                           \
                                                                                                \
    void rms_norm_heads_##SUFFIX(const T *x, int64_t token_stride, int64_t heads, const T *weight, T *out, \
                                 int64_t tokens, int64_t head_dim, double eps, int num_threads) {     \
        _Pragma("omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < tokens * heads; r++)                                            \
            rms_row_##SUFFIX(x + (r / heads) * token_stride + (r % heads) * head_dim, weight,  \
                             out + r * head_dim, head_dim, (float)eps);                         \
    }                                                                                           \
                                                                                                \
    void add_rms_norm_##SUFFIX(T *x, int64_t x_stride, const T *delta, int64_t delta_stride,    \
                               const T *weight, T *out, int64_t out_stride, int64_t rows,       \
                               int64_t cols, double eps, int num_threads) {                     \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < rows; r++) {                                                    \
            T *xr = x + r * x_stride;                                                           \
            const T *dr = delta + r * delta_stride;                                             \
            add_row_##SUFFIX(xr, dr, cols);                                                     \
            rms_row_##SUFFIX(xr, weight, out + r * out_stride, cols, (float)eps);               \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    void add_rows_##SUFFIX(T *x, int64_t x_stride, const T *delta, int64_t delta_stride,         \
                           int64_t rows, int64_t cols, int num_threads) {                       \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < rows; r++)                                                      \
            add_row_##SUFFIX(x + r * x_stride, delta + r * delta_stride, cols);                 \
    }                                                                                           \
                                                                                                \
    void silu_mul_##SUFFIX(const T *gate_up, int64_t stride, T *out, int64_t out_stride,        \
                           int64_t rows, int64_t cols, int num_threads) {                       \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < rows; r++) {                                                    \
            const T *gate = gate_up + r * stride;                                               \
            silu_mul_row_##SUFFIX(gate, gate + cols, out + r * out_stride, cols);               \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    void rotary_##SUFFIX(T *q, int64_t q_stride, int64_t q_heads, T *k, int64_t k_stride,       \
                         int64_t k_heads, const T *cos, const T *sin, int64_t tokens,           \
                         int64_t head_dim, int num_threads) {                                   \
        const int64_t half = head_dim / 2;                                                      \
        _Pragma("omp parallel for num_threads(num_threads) if (tokens * (q_heads + k_heads) * head_dim >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t t = 0; t < tokens; t++) {                                                  \
            const T *ct = cos + t * head_dim, *st = sin + t * head_dim;                         \
            for (int64_t h = 0; h < q_heads; h++)                                               \
                rotate_head_##SUFFIX(q + t * q_stride + h * head_dim, ct, st, half);            \
            for (int64_t h = 0; h < k_heads; h++)                                               \
                rotate_head_##SUFFIX(k + t * k_stride + h * head_dim, ct, st, half);            \
        }                                                                                       \
    }

DEFINE_FUSED(f32, float)
DEFINE_FUSED(bf16, uint16_t)

/* Token t's key row (k_bytes) goes to slot slots[t] of k_cache, its value row (v_bytes)
 * to the same slot of v_cache; key and value rows are key_stride and value_stride bytes
 * apart, the caches' slots k_bytes and v_bytes. Every slot is checked against num_slots
 * before anything is written: returns how many are out of range (0: all written). */
int64_t kv_write(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *k_cache,
                 char *v_cache, int64_t num_slots, const int64_t *slots, int64_t tokens, int64_t k_bytes,
                 int64_t v_bytes) {
    int64_t out_of_range = 0;
    for (int64_t t = 0; t < tokens; t++)
        out_of_range += slots[t] < 0 || slots[t] >= num_slots;
    if (out_of_range)
        return out_of_range;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(k_cache + slots[t] * k_bytes, key + t * key_stride, (size_t)k_bytes);
        memcpy(v_cache + slots[t] * v_bytes, value + t * value_stride, (size_t)v_bytes);
    }
    return 0;
}

/* kv_write, returning nothing: where more slots than *out_of_range fall out of range
 * (nothing written then), their count goes there, which the caller reads after the
 * call, or after the replay of a recorded program that holds it (every layer's write
 * of a step checks the same slots). */
void kv_write_noting(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *k_cache,
                     char *v_cache, int64_t num_slots, const int64_t *slots, int64_t tokens, int64_t k_bytes,
                     int64_t v_bytes, int64_t *out_of_range) {
    const int64_t count = kv_write(key, key_stride, value, value_stride, k_cache, v_cache, num_slots, slots, tokens,
                                   k_bytes, v_bytes);
    if (count > *out_of_range)
        *out_of_range = count;
}
