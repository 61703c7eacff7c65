/* The gated delta-net's recurrent core on the CPU (kernels/cpu_recurrent.py launches
 * it): from the projected q|k|v rows to the delta rule's outputs, for a packed batch
 * of requests, prefill chunks and decode tokens alike, in one call per layer.
 *
 * Per request b and value head h (its key head hk = h / repeat), token by token:
 *   x_c    = silu(sum_j w[c, j] in[t - (W - 1) + j, c] + bias[c])  (causal convolution of
 *            each channel c over the request's own inputs, its saved window before them)
 *   q, k   = l2-normalised key-head hk channels of x (q also times scale), v: head h's
 *   S     <- e^{g_t} S,   u = beta_t (v - S^T k),   S <- S + k u^T,   o_t = S^T q
 * S [K, V] stays in L1 through a request's tokens (16 KiB for a 64 x 64 float32 head),
 * so the recurrence costs the chunked form's arithmetic order with no memory traffic.
 * Each value head recomputes its key head's q and k (K channels, W taps each: little
 * beside the K x V update), so (request, value head) pairs run independently; the
 * convolution windows are rewritten after all of them have read the old ones.
 *
 * Layout: x [T, C] rows with stride x_stride (C = 2 Hk K + H V: q, k, v channels);
 * weight [C, W] contiguous, bias [C] or NULL; g, beta [T, H]; conv_state [B, W-1, C]
 * and state [B, H, K, V] contiguous, read where has_initial_state[b] and overwritten
 * with each request's final window and state; out [T, H, V]; cu_seqlens [B + 1] int64.
 * One element type throughout: float32 or float64.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

/* Largest head sizes the kernel takes (its per-token vectors live on the stack). */
#define MAX_HEAD_DIM 256

/* Work below this many state elements times tokens runs on the calling thread. */
#define PARALLEL_MIN_WORK (1 << 16)

#define DEFINE_GATED_DELTA_NET(SUFFIX, T, EXP, SQRT)                                            \
    static inline T silu_##SUFFIX(T x) { return x / ((T)1 + EXP(-x)); }                         \
                                                                                                \
    /* The convolution's output for channels [c0, c0 + n) at the request's token t; the     \
     * inputs before the request's first token come from its window (zero without one). */ \
    static inline void conv_channels_##SUFFIX(                                                  \
        const T *x, int64_t x_stride, int64_t start, int64_t t, const T *window, int64_t width, \
        int64_t channels, const T *weight, const T *bias, int64_t c0, int64_t n, T *out) {     \
        for (int64_t i = 0; i < n; i++) out[i] = 0;                                             \
        for (int64_t j = 0; j < width; j++) {                                                   \
            const int64_t p = t - (width - 1) + j; /* the tap's token, < 0: in the window */   \
            const T *row = p >= 0 ? x + (start + p) * x_stride                                  \
                                  : (window ? window + (width - 1 + p) * channels : NULL);      \
            if (!row) continue;                                                                 \
            _Pragma("omp simd")                                                                 \
            for (int64_t i = 0; i < n; i++) out[i] += row[c0 + i] * weight[(c0 + i) * width + j]; \
        }                                                                                       \
        _Pragma("omp simd")                                                                     \
        for (int64_t i = 0; i < n; i++) out[i] = silu_##SUFFIX(out[i] + (bias ? bias[c0 + i] : (T)0)); \
    }                                                                                           \
                                                                                                \
    static inline void l2_normalize_##SUFFIX(T *x, int64_t n, T eps, T scale) {                 \
        T sum = 0;                                                                              \
        _Pragma("omp simd reduction(+:sum)")                                                    \
        for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];                                     \
        const T factor = scale / SQRT(sum + eps);                                               \
        _Pragma("omp simd")                                                                     \
        for (int64_t i = 0; i < n; i++) x[i] *= factor;                                         \
    }                                                                                           \
                                                                                                \
    /* One token's update of S [K, V] and its output o [V]: two passes over S's rows.       \
     * Inlined with constant sizes, the V-wide accumulators stay in registers. */           \
    static inline __attribute__((always_inline)) void delta_step_##SUFFIX(                     \
        T *restrict state, const T *restrict q, const T *restrict k, const T *restrict v,      \
        T decay, T beta, T *restrict o, const int64_t key_dim, const int64_t value_dim) {      \
        T predicted[MAX_HEAD_DIM], update[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];                     \
        for (int64_t j = 0; j < value_dim; j++) predicted[j] = 0;                               \
        for (int64_t i = 0; i < key_dim; i++) {                                                 \
            T *restrict row = state + i * value_dim;                                            \
            const T ki = k[i];                                                                  \
            _Pragma("omp simd")                                                                 \
            for (int64_t j = 0; j < value_dim; j++) {                                           \
                const T s = row[j] * decay;                                                     \
                row[j] = s;                                                                     \
                predicted[j] += ki * s;                                                         \
            }                                                                                   \
        }                                                                                       \
        for (int64_t j = 0; j < value_dim; j++) {                                               \
            update[j] = (v[j] - predicted[j]) * beta;                                           \
            acc[j] = 0;                                                                         \
        }                                                                                       \
        for (int64_t i = 0; i < key_dim; i++) {                                                 \
            T *restrict row = state + i * value_dim;                                            \
            const T ki = k[i], qi = q[i];                                                       \
            _Pragma("omp simd")                                                                 \
            for (int64_t j = 0; j < value_dim; j++) {                                           \
                const T s = row[j] + ki * update[j];                                            \
                row[j] = s;                                                                     \
                acc[j] += qi * s;                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int64_t j = 0; j < value_dim; j++) o[j] = acc[j];                                  \
    }                                                                                           \
                                                                                                \
    static void delta_step_any_##SUFFIX(T *state, const T *q, const T *k, const T *v, T decay, \
                                        T beta, T *o, int64_t key_dim, int64_t value_dim) {    \
        if (key_dim == 64 && value_dim == 64)                                                   \
            delta_step_##SUFFIX(state, q, k, v, decay, beta, o, 64, 64);                        \
        else if (key_dim == 128 && value_dim == 128)                                            \
            delta_step_##SUFFIX(state, q, k, v, decay, beta, o, 128, 128);                      \
        else if (key_dim == 128 && value_dim == 256)                                            \
            delta_step_##SUFFIX(state, q, k, v, decay, beta, o, 128, 256);                      \
        else                                                                                    \
            delta_step_##SUFFIX(state, q, k, v, decay, beta, o, key_dim, value_dim);            \
    }                                                                                           \
                                                                                                \
    /* Request b's tokens through value head h, its state S in place. */                     \
    static void head_tokens_##SUFFIX(                                                           \
        const T *x, int64_t x_stride, const T *weight, const T *bias, const T *g,              \
        const T *beta, const T *window, T *state, T *out, int64_t start, int64_t length,       \
        int64_t h, int64_t num_heads, int64_t num_key_heads, int64_t key_dim, int64_t value_dim, \
        int64_t width, int64_t channels, T scale, T eps) {                                      \
        const int64_t key_head = h / (num_heads / num_key_heads);                               \
        const int64_t q_channel = key_head * key_dim;                                           \
        const int64_t k_channel = num_key_heads * key_dim + key_head * key_dim;                 \
        const int64_t v_channel = 2 * num_key_heads * key_dim + h * value_dim;                  \
        T q[MAX_HEAD_DIM], k[MAX_HEAD_DIM], v[MAX_HEAD_DIM];                                    \
        for (int64_t t = 0; t < length; t++) {                                                  \
            const int64_t token = start + t;                                                    \
            conv_channels_##SUFFIX(x, x_stride, start, t, window, width, channels, weight, bias, \
                                   q_channel, key_dim, q);                                      \
            conv_channels_##SUFFIX(x, x_stride, start, t, window, width, channels, weight, bias, \
                                   k_channel, key_dim, k);                                      \
            conv_channels_##SUFFIX(x, x_stride, start, t, window, width, channels, weight, bias, \
                                   v_channel, value_dim, v);                                    \
            l2_normalize_##SUFFIX(q, key_dim, eps, scale);                                      \
            l2_normalize_##SUFFIX(k, key_dim, eps, (T)1);                                       \
            delta_step_any_##SUFFIX(state, q, k, v, EXP(g[token * num_heads + h]),              \
                                    beta[token * num_heads + h],                                \
                                    out + (token * num_heads + h) * value_dim, key_dim, value_dim); \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    /* Request b's next window: the last W - 1 inputs of its window followed by its tokens, \
     * rewritten in place in increasing order (each row reads one at or after itself). */  \
    static void next_window_##SUFFIX(const T *x, int64_t x_stride, T *window, int init,        \
                                     int64_t start, int64_t length, int64_t width, int64_t channels) { \
        for (int64_t i = 0; i < width - 1; i++) {                                               \
            const int64_t p = length + i - (width - 1); /* < 0: in the old window */           \
            T *row = window + i * channels;                                                     \
            if (p >= 0)                                                                         \
                memcpy(row, x + (start + p) * x_stride, channels * sizeof(T));                  \
            else if (init)                                                                      \
                memmove(row, window + (width - 1 + p) * channels, channels * sizeof(T));        \
            else                                                                                \
                memset(row, 0, channels * sizeof(T));                                           \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    void gated_delta_net_##SUFFIX(                                                              \
        const T *x, int64_t x_stride, const T *weight, const T *bias, int64_t width,           \
        const T *g, const T *beta, const int64_t *cu_seqlens, const uint8_t *has_initial_state, \
        int64_t num_requests, T *conv_state, T *state, T *out, int64_t num_heads,              \
        int64_t num_key_heads, int64_t key_dim, int64_t value_dim, double scale, double eps,   \
        int num_threads) {                                                                      \
        const int64_t channels = 2 * num_key_heads * key_dim + num_heads * value_dim;          \
        const int64_t state_size = key_dim * value_dim;                                         \
        const int64_t work = cu_seqlens[num_requests] * num_heads * state_size;                 \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (work >= PARALLEL_MIN_WORK)") \
        for (int64_t task = 0; task < num_requests * num_heads; task++) {                       \
            const int64_t b = task / num_heads, h = task % num_heads;                           \
            const int init = has_initial_state[b] != 0;                                         \
            T *head_state = state + task * state_size;                                          \
            if (!init) memset(head_state, 0, state_size * sizeof(T));                           \
            head_tokens_##SUFFIX(x, x_stride, weight, bias, g, beta,                            \
                                 init ? conv_state + b * (width - 1) * channels : NULL,         \
                                 head_state, out, cu_seqlens[b], cu_seqlens[b + 1] - cu_seqlens[b], \
                                 h, num_heads, num_key_heads, key_dim, value_dim, width, channels, \
                                 (T)scale, (T)eps);                                             \
        }                                                                                       \
        _Pragma("omp parallel for num_threads(num_threads) if (work >= PARALLEL_MIN_WORK)")   \
        for (int64_t b = 0; b < num_requests; b++)                                              \
            next_window_##SUFFIX(x, x_stride, conv_state + b * (width - 1) * channels,          \
                                 has_initial_state[b] != 0, cu_seqlens[b],                      \
                                 cu_seqlens[b + 1] - cu_seqlens[b], width, channels);           \
    }

DEFINE_GATED_DELTA_NET(f32, float, expf, sqrtf)
DEFINE_GATED_DELTA_NET(f64, double, exp, sqrt)
