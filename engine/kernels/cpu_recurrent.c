/* The CPU kernels of recurrent layers (kernels/cpu_recurrent.py launches them): the
 * recurrent core of gated delta-net and Kimi delta attention layers (below), the
 * causal convolution alone, and float32 Mamba and Mamba-2 decode updates (each
 * described where it is defined).
 *
 * The recurrent core goes from the projected q|k|v rows to the delta rule's outputs,
 * for a packed batch of requests, prefill chunks and decode tokens alike, in one call
 * per layer.
 *
 * Per request b and value head h (its key head hk = h / repeat), token by token:
 *   x_c    = silu(sum_j w[c, j] in[t - (W - 1) + j, c] + bias[c])  (causal convolution of
 *            each channel c over the request's own inputs, its saved window before them)
 *   q, k   = l2-normalised key-head hk channels of x (q also times scale), v: head h's
 *   S     <- diag(e^{g_t}) S,   u = beta_t (v - S^T k),   S <- S + k u^T,   o_t = S^T q
 * with g_t one log decay per head (gated delta-net) or per key channel (Kimi delta
 * attention).
 * S [K, V] stays in L1 through a request's tokens (16 KiB for a 64 x 64 float32 head),
 * so the recurrence costs the chunked form's arithmetic order with no memory traffic.
 * Each value head recomputes its key head's q and k (K channels, W taps each: little
 * beside the K x V update), so (request, value head) pairs run independently; the
 * convolution windows are rewritten after all of them have read the old ones.
 *
 * Layout: x [T, C] rows with stride x_stride (C = 2 Hk K + H V: q, k, v channels);
 * weight [W, C] contiguous (the taps' rows, so a tap reads its channels in a row);
 * bias [C] or NULL; g [T, H] or, where g_per_key, [T, H, K]; beta [T, H]; conv_state
 * [B, W-1, C] and state [B, H, K, V] contiguous, read where has_initial_state[b] and
 * overwritten with each request's final window and state; out [T, H, V]; cu_seqlens
 * [B + 1] int64.
 * One element type throughout: float32 or float64.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

/* Largest head sizes the kernel takes (its per-token vectors live on the stack). */
#define MAX_HEAD_DIM 256

/* Channels per task of the convolution alone. */
#define CONV_BLOCK 256

/* How many tokens ahead a head's loop asks for its input rows. */
#define PREFETCH_TOKENS 8

/* Work below this many state elements times tokens runs on the calling thread. */
#define PARALLEL_MIN_WORK (1 << 16)

/* float32's SiLU through cpu_common.h's exp_f32 (no libm call, so the channel loop
 * vectorizes; within about 2 ulp of expf). */
static inline float silu_f32(float x) { return x / (1.0f + exp_f32(-x)); }
static inline double silu_f64(double x) { return x / (1.0 + exp(-x)); }

#define DEFINE_RECURRENT_KERNELS(SUFFIX, T, EXP, EXP_LANES, SQRT)                               \
                                                                                                \
    /* The convolution's taps summed for channels [c0, c0 + n) at the request's token t; the \
     * inputs before the request's first token come from its window (zero without one). */ \
    static inline void conv_taps_##SUFFIX(                                                      \
        const T *x, int64_t x_stride, int64_t start, int64_t t, const T *window, int64_t width, \
        int64_t channels, const T *weight, int64_t c0, int64_t n, T *out) {                     \
        for (int64_t i = 0; i < n; i++) out[i] = 0;                                             \
        for (int64_t j = 0; j < width; j++) {                                                   \
            const int64_t p = t - (width - 1) + j; /* the tap's token, < 0: in the window */   \
            const T *row = p >= 0 ? x + (start + p) * x_stride                                  \
                                  : (window ? window + (width - 1 + p) * channels : NULL);      \
            if (!row) continue;                                                                 \
            _Pragma("omp simd")                                                                 \
            for (int64_t i = 0; i < n; i++) out[i] += row[c0 + i] * weight[j * channels + c0 + i]; \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    /* silu(taps + bias) for channels [c0, c0 + n) at token t: the delta rules' q, k, v. */  \
    static inline void conv_channels_##SUFFIX(                                                  \
        const T *x, int64_t x_stride, int64_t start, int64_t t, const T *window, int64_t width, \
        int64_t channels, const T *weight, const T *bias, int64_t c0, int64_t n, T *out) {     \
        conv_taps_##SUFFIX(x, x_stride, start, t, window, width, channels, weight, c0, n, out); \
        _Pragma("omp simd")                                                                     \
        for (int64_t i = 0; i < n; i++) out[i] = silu_##SUFFIX(out[i] + (bias ? bias[c0 + i] : (T)0)); \
    }                                                                                           \
                                                                                                \
    /* A later token's channels [row, row + n) on their way to the cache: each (request,   \
     * head) pair reads a few hundred bytes of rows thousands apart, which the hardware's  \
     * prefetchers do not foresee, and its pass over S leaves the loads nothing to overlap. */ \
    static inline void prefetch_##SUFFIX(const T *row, int64_t n) {                             \
        for (int64_t i = 0; i < n; i += 64 / sizeof(T)) __builtin_prefetch(row + i);           \
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
    /* S^T (d * k) for the first token (later tokens' come out of their predecessor's pass). */ \
    static inline __attribute__((always_inline)) void predict_##SUFFIX(                        \
        const T *restrict state, const T *restrict decayed_k, T *restrict predicted,           \
        const int64_t key_dim, const int64_t value_dim) {                                       \
        for (int64_t j = 0; j < value_dim; j++) predicted[j] = 0;                               \
        for (int64_t i = 0; i < key_dim; i++) {                                                 \
            const T *restrict row = state + i * value_dim;                                      \
            const T ki = decayed_k[i];                                                          \
            _Pragma("omp simd")                                                                 \
            for (int64_t j = 0; j < value_dim; j++) predicted[j] += ki * row[j];                \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    /* One token's update in one pass over S's rows, with predicted = S_{t-1}^T (d * k_t)   \
     * (d: the token's decay of each row): u = beta (v - predicted), S_t = diag(d) S_{t-1}  \
     * + k u^T, o = S_t^T q, and where the request has a next token, next_predicted =       \
     * S_t^T (d' * k_{t+1}). Inlined with constant sizes, the V-wide accumulators stay in  \
     * registers; S is stored once per token. */                                            \
    static inline __attribute__((always_inline)) void delta_pass_##SUFFIX(                     \
        T *restrict state, const T *restrict q, const T *restrict k, const T *restrict v,      \
        const T *restrict decay, const T *restrict next_decayed_k, T beta,                     \
        const T *restrict predicted, T *restrict next_predicted, T *restrict o,                \
        const int64_t key_dim, const int64_t value_dim, const int has_next) {                  \
        T update[MAX_HEAD_DIM], acc[MAX_HEAD_DIM], next[MAX_HEAD_DIM];                          \
        for (int64_t j = 0; j < value_dim; j++) {                                               \
            update[j] = (v[j] - predicted[j]) * beta;                                           \
            acc[j] = 0;                                                                         \
            next[j] = 0;                                                                        \
        }                                                                                       \
        for (int64_t i = 0; i < key_dim; i++) {                                                 \
            T *restrict row = state + i * value_dim;                                            \
            const T ki = k[i], qi = q[i], di = decay[i], ni = has_next ? next_decayed_k[i] : (T)0; \
            _Pragma("omp simd")                                                                 \
            for (int64_t j = 0; j < value_dim; j++) {                                           \
                const T s = row[j] * di + ki * update[j];                                       \
                row[j] = s;                                                                     \
                acc[j] += qi * s;                                                               \
                if (has_next) next[j] += ni * s;                                                \
            }                                                                                   \
        }                                                                                       \
        for (int64_t j = 0; j < value_dim; j++) o[j] = acc[j];                                  \
        if (has_next)                                                                           \
            for (int64_t j = 0; j < value_dim; j++) next_predicted[j] = next[j];                \
    }                                                                                           \
                                                                                                \
    /* The pass with the sizes as constants where they are common ones. */                   \
    static void delta_pass_any_##SUFFIX(T *state, const T *q, const T *k, const T *v,          \
                                        const T *decay, const T *next_decayed_k, T beta,       \
                                        const T *predicted, T *next_predicted, T *o,           \
                                        int64_t key_dim, int64_t value_dim) {                   \
        if (next_decayed_k == NULL)                                                             \
            delta_pass_##SUFFIX(state, q, k, v, decay, next_decayed_k, beta, predicted,        \
                                next_predicted, o, key_dim, value_dim, 0);                      \
        else if (key_dim == 64 && value_dim == 64)                                              \
            delta_pass_##SUFFIX(state, q, k, v, decay, next_decayed_k, beta, predicted,        \
                                next_predicted, o, 64, 64, 1);                                  \
        else if (key_dim == 128 && value_dim == 128)                                            \
            delta_pass_##SUFFIX(state, q, k, v, decay, next_decayed_k, beta, predicted,        \
                                next_predicted, o, 128, 128, 1);                                \
        else                                                                                    \
            delta_pass_##SUFFIX(state, q, k, v, decay, next_decayed_k, beta, predicted,        \
                                next_predicted, o, key_dim, value_dim, 1);                      \
    }                                                                                           \
                                                                                                \
    /* One token's q, k (normalised, q scaled), v for value head h, its decay of each key   \
     * row, d = e^g (g per head, or per key channel where g_per_key), and d * k. */         \
    static inline void token_inputs_##SUFFIX(                                                   \
        const T *x, int64_t x_stride, int64_t start, int64_t t, const T *window, int64_t width, \
        int64_t channels, const T *weight, const T *bias, const T *g, int g_per_key,           \
        int64_t q_channel, int64_t k_channel, int64_t v_channel, int64_t key_dim,              \
        int64_t value_dim, T scale, T eps, T *q, T *k, T *v, T *decay, T *decayed_k) {          \
        conv_channels_##SUFFIX(x, x_stride, start, t, window, width, channels, weight, bias,   \
                               q_channel, key_dim, q);                                          \
        conv_channels_##SUFFIX(x, x_stride, start, t, window, width, channels, weight, bias,   \
                               k_channel, key_dim, k);                                          \
        conv_channels_##SUFFIX(x, x_stride, start, t, window, width, channels, weight, bias,   \
                               v_channel, value_dim, v);                                        \
        l2_normalize_##SUFFIX(q, key_dim, eps, scale);                                          \
        l2_normalize_##SUFFIX(k, key_dim, eps, (T)1);                                           \
        if (g_per_key) {                                                                        \
            _Pragma("omp simd")                                                                 \
            for (int64_t i = 0; i < key_dim; i++) decay[i] = EXP_LANES(g[i]);                   \
        } else {                                                                                \
            const T head_decay = EXP(g[0]);                                                     \
            for (int64_t i = 0; i < key_dim; i++) decay[i] = head_decay;                        \
        }                                                                                       \
        _Pragma("omp simd")                                                                     \
        for (int64_t i = 0; i < key_dim; i++) decayed_k[i] = decay[i] * k[i];                   \
    }                                                                                           \
                                                                                                \
    /* Request b's tokens through value head h, its state S in place. Two sets of per-token \
     * vectors: the current token's and the next one's, whose decayed key its pass reads. */ \
    static void head_tokens_##SUFFIX(                                                           \
        const T *x, int64_t x_stride, const T *weight, const T *bias, const T *g, int g_per_key, \
        const T *beta, const T *window, T *state, T *out, int64_t start, int64_t length,       \
        int64_t h, int64_t num_heads, int64_t num_key_heads, int64_t key_dim, int64_t value_dim, \
        int64_t width, int64_t channels, T scale, T eps) {                                      \
        const int64_t key_head = h / (num_heads / num_key_heads);                               \
        const int64_t q_channel = key_head * key_dim;                                           \
        const int64_t k_channel = num_key_heads * key_dim + key_head * key_dim;                 \
        const int64_t v_channel = 2 * num_key_heads * key_dim + h * value_dim;                  \
        const int64_t g_stride = g_per_key ? key_dim : 1; /* per head */                        \
        T q[2][MAX_HEAD_DIM], k[2][MAX_HEAD_DIM], v[2][MAX_HEAD_DIM], predicted[2][MAX_HEAD_DIM]; \
        T decay[2][MAX_HEAD_DIM], decayed_k[2][MAX_HEAD_DIM];                                   \
        if (length == 0) return;                                                                \
        token_inputs_##SUFFIX(x, x_stride, start, 0, window, width, channels, weight, bias,    \
                              g + (start * num_heads + h) * g_stride, g_per_key, q_channel,     \
                              k_channel, v_channel, key_dim, value_dim, scale, eps, q[0], k[0], \
                              v[0], decay[0], decayed_k[0]);                                    \
        if (key_dim == 64 && value_dim == 64)                                                   \
            predict_##SUFFIX(state, decayed_k[0], predicted[0], 64, 64);                        \
        else                                                                                    \
            predict_##SUFFIX(state, decayed_k[0], predicted[0], key_dim, value_dim);            \
        for (int64_t t = 0; t < length; t++) {                                                  \
            const int now = t & 1, next = now ^ 1;                                              \
            const int64_t token = start + t;                                                    \
            if (t + PREFETCH_TOKENS < length) {                                                 \
                const T *row = x + (token + PREFETCH_TOKENS) * x_stride;                        \
                prefetch_##SUFFIX(row + q_channel, key_dim);                                    \
                prefetch_##SUFFIX(row + k_channel, key_dim);                                    \
                prefetch_##SUFFIX(row + v_channel, value_dim);                                  \
            }                                                                                   \
            if (t + 1 < length)                                                                 \
                token_inputs_##SUFFIX(x, x_stride, start, t + 1, window, width, channels, weight, \
                                      bias, g + ((token + 1) * num_heads + h) * g_stride,       \
                                      g_per_key, q_channel, k_channel, v_channel, key_dim,      \
                                      value_dim, scale, eps, q[next], k[next], v[next],         \
                                      decay[next], decayed_k[next]);                            \
            delta_pass_any_##SUFFIX(state, q[now], k[now], v[now], decay[now],                  \
                                    t + 1 < length ? decayed_k[next] : NULL,                    \
                                    beta[token * num_heads + h], predicted[now], predicted[next], \
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
    void delta_rule_core_##SUFFIX(                                                              \
        const T *x, int64_t x_stride, const T *weight, const T *bias, int64_t width,           \
        const T *g, int g_per_key, const T *beta, const int64_t *cu_seqlens,                   \
        const uint8_t *has_initial_state,                                                       \
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
            head_tokens_##SUFFIX(x, x_stride, weight, bias, g, g_per_key, beta,                 \
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
    }                                                                                           \
                                                                                                \
    /* The depthwise causal convolution alone (short-convolution, Mamba, Mamba-2, RG-LRU): \
     * out [T, C] = act(sum_j w[j, c] in[t - (W - 1) + j, c] + bias[c]), act SiLU where     \
     * silu, else none; the windows as above. Parallel over requests and blocks of         \
     * CONV_BLOCK channels, each block's taps over a request's tokens in order. */          \
    void causal_conv1d_##SUFFIX(                                                                \
        const T *x, int64_t x_stride, const T *weight, const T *bias, int64_t width,           \
        const int64_t *cu_seqlens, const uint8_t *has_initial_state, int64_t num_requests,      \
        T *conv_state, T *out, int64_t channels, int silu, int num_threads) {                   \
        const int64_t blocks = (channels + CONV_BLOCK - 1) / CONV_BLOCK;                         \
        const int64_t work = cu_seqlens[num_requests] * channels * width;                       \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (work >= PARALLEL_MIN_WORK)") \
        for (int64_t task = 0; task < num_requests * blocks; task++) {                          \
            const int64_t b = task / blocks, c0 = (task % blocks) * CONV_BLOCK;                  \
            const int64_t n = channels - c0 < CONV_BLOCK ? channels - c0 : CONV_BLOCK;           \
            const int64_t start = cu_seqlens[b], length = cu_seqlens[b + 1] - start;             \
            const T *window = has_initial_state[b] ? conv_state + b * (width - 1) * channels : NULL; \
            for (int64_t t = 0; t < length; t++) {                                              \
                T *o = out + (start + t) * channels + c0;                                       \
                conv_taps_##SUFFIX(x, x_stride, start, t, window, width, channels, weight, c0, n, o); \
                if (bias) {                                                                     \
                    _Pragma("omp simd")                                                         \
                    for (int64_t i = 0; i < n; i++) o[i] += bias[c0 + i];                       \
                }                                                                               \
                if (silu) {                                                                     \
                    _Pragma("omp simd")                                                         \
                    for (int64_t i = 0; i < n; i++) o[i] = silu_##SUFFIX(o[i]);                 \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        _Pragma("omp parallel for num_threads(num_threads) if (work >= PARALLEL_MIN_WORK)")   \
        for (int64_t b = 0; b < num_requests; b++)                                              \
            next_window_##SUFFIX(x, x_stride, conv_state + b * (width - 1) * channels,          \
                                 has_initial_state[b] != 0, cu_seqlens[b],                      \
                                 cu_seqlens[b + 1] - cu_seqlens[b], width, channels);           \
    }

/* One decode token of a Mamba-2 (SSD) mixer per request, float32 as the Hugging Face
 * update runs it: per request b and head h (its group g = h / (H / G)), with the state
 * S [P, N] updated in place in one pass,
 *   S <- e^{dt A_h} S + dt x B^T,   y = S C + D_h x.
 * Layout: state [R, H, P, N] contiguous; x rows [R, H P] with stride x_stride; B and C
 * rows [R, G N] with stride bc_stride; dt [R, H] contiguous; A, D [H] (D may be NULL);
 * y [R, H, P] contiguous. */
void ssd_decode_f32(float *state, const float *x, int64_t x_stride, const float *dt, const float *A,
                    const float *B, const float *C, int64_t bc_stride, const float *D, float *y,
                    int64_t requests, int64_t heads, int64_t groups, int64_t head_dim, int64_t state_size,
                    int num_threads) {
    const int64_t size = head_dim * state_size;
    _Pragma("omp parallel for num_threads(num_threads) if (requests * heads * size >= PARALLEL_MIN_WORK)")
    for (int64_t task = 0; task < requests * heads; task++) {
        const int64_t b = task / heads, h = task % heads, g = h / (heads / groups);
        const float step = dt[task], decay = expf(step * A[h]);
        const float *xh = x + b * x_stride + h * head_dim;
        const float *Bg = B + b * bc_stride + g * state_size, *Cg = C + b * bc_stride + g * state_size;
        float *S = state + task * size;
        for (int64_t p = 0; p < head_dim; p++) {
            float *row = S + p * state_size;
            const float xp = xh[p];
            float sum = 0;
            _Pragma("omp simd reduction(+:sum)")
            for (int64_t n = 0; n < state_size; n++) {
                const float s = row[n] * decay + step * Bg[n] * xp;
                row[n] = s;
                sum += s * Cg[n];
            }
            y[task * head_dim + p] = D ? sum + xp * D[h] : sum;
        }
    }
}

/* One decode token of a Mamba (selective scan) mixer per request, float32 as the Hugging
 * Face update runs it: per request b and channel c (its group g = c / (Dc / G)), the
 * state row s [N] updated in place,
 *   s <- e^{dt_c A_c} s + dt_c B_g x_c,   y_c = (s . C_g + D_c x_c) silu(z_c).
 * Layout: state [R, Dc, N] contiguous; x, dt and z rows [R, Dc] with strides x_stride,
 * dt_stride and z_stride (z may be NULL); B and C rows [R, G N] with stride bc_stride;
 * A [Dc, N] contiguous; D [Dc] or NULL; y [R, Dc] contiguous. Parallel over requests
 * and blocks of CONV_BLOCK channels. */
void selective_decode_f32(float *state, const float *x, int64_t x_stride, const float *dt, int64_t dt_stride,
                          const float *A, const float *B, const float *C, int64_t bc_stride, const float *D,
                          const float *z, int64_t z_stride, float *y, int64_t requests, int64_t channels,
                          int64_t groups, int64_t state_size, int num_threads) {
    const int64_t blocks = (channels + CONV_BLOCK - 1) / CONV_BLOCK, per_group = channels / groups;
    _Pragma("omp parallel for num_threads(num_threads) if (requests * channels * state_size >= PARALLEL_MIN_WORK)")
    for (int64_t task = 0; task < requests * blocks; task++) {
        const int64_t b = task / blocks, c0 = (task % blocks) * CONV_BLOCK;
        const int64_t c1 = c0 + CONV_BLOCK < channels ? c0 + CONV_BLOCK : channels;
        for (int64_t c = c0; c < c1; c++) {
            const int64_t g = c / per_group;
            const float step = dt[b * dt_stride + c], xc = x[b * x_stride + c];
            const float *Bg = B + b * bc_stride + g * state_size, *Cg = C + b * bc_stride + g * state_size;
            const float *Ac = A + c * state_size;
            float *row = state + (b * channels + c) * state_size;
            float sum = 0;
            _Pragma("omp simd reduction(+:sum)")
            for (int64_t n = 0; n < state_size; n++) {
                const float s = row[n] * exp_f32(step * Ac[n]) + step * Bg[n] * xc;
                row[n] = s;
                sum += s * Cg[n];
            }
            if (D) sum += xc * D[c];
            if (z) sum *= silu_f32(z[b * z_stride + c]);
            y[b * channels + c] = sum;
        }
    }
}

/* EXP_LANES: the exponential in a loop over channels (float32: exp_f32, which vectorizes). */
DEFINE_RECURRENT_KERNELS(f32, float, expf, exp_f32, sqrtf)
DEFINE_RECURRENT_KERNELS(f64, double, exp, exp, sqrt)
