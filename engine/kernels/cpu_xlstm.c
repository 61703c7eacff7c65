/* xLSTM's mLSTM step recurrence over a packed batch on the CPU, float32: the tokens
 * transformers computes one at a time (decode tokens, and what is left of a prompt
 * chunk after its whole chunks). The arithmetic is xlstm_mlstm.py's mlstm_step (its
 * plain-torch reference, with step_loop_varlen): per head a matrix memory C [DQK, DV],
 * a normaliser n [DQK] and the running maximum m of the log gates.
 *
 * Layout (the launcher, cpu_xlstm.py, asserts it): q, k [T, NH, DQK] and v, h
 * [T, NH, DV] with token strides q_stride, k_stride, v_stride, h_stride, heads side by
 * side and unit element stride; igate, fgate [T, NH] with token strides i_stride,
 * f_stride and unit head stride (pre-activations, soft-capped); starts, lengths [B]:
 * request b's tokens are starts[b] .. starts[b] + lengths[b] - 1; c [B, NH, DQK, DV],
 * n [B, NH, DQK], m [B, NH] contiguous, holding each request's entering state and
 * receiving the state after its last token (untouched where lengths[b] is 0). Parallel
 * over (request, head) pairs; each pair updates its state in place, token by token,
 * the readout q C fused into the update's pass over C. Plain C with libm's expf and
 * log1pf, no instruction-set intrinsics: the compiler vectorizes the DV-wide rows. */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN_WORK (1 << 15)

static inline float log_sigmoid(float x) { return fminf(x, 0.0f) - log1pf(expf(-fabsf(x))); }

static void head_tokens(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                        int64_t v_stride, float *h, int64_t h_stride, const float *igate, int64_t i_stride,
                        const float *fgate, int64_t f_stride, int64_t first, int64_t count, float *c, float *n,
                        float *m, int64_t dqk, int64_t dv, float eps) {
    const float scale = (float)pow((double)dqk, -0.5); /* as torch scales by the double dqk ** -0.5 */
    for (int64_t t = first; t < first + count; t++) {
        const float *qt = q + t * q_stride, *kt = k + t * k_stride, *vt = v + t * v_stride;
        float *ht = h + t * h_stride;
        const float log_f = log_sigmoid(fgate[t * f_stride]), i = igate[t * i_stride];
        const float m_new = fmaxf(log_f + *m, i);
        const float decay = expf(log_f + *m - m_new), gain = expf(i - m_new);
        float qn = 0.0f;
        for (int64_t j = 0; j < dv; j++) ht[j] = 0.0f;
        for (int64_t d = 0; d < dqk; d++) {
            const float kd = kt[d], qd = qt[d] * scale;
            float *row = c + d * dv;
            _Pragma("omp simd")
            for (int64_t j = 0; j < dv; j++) {
                row[j] = decay * row[j] + gain * (kd * vt[j]);
                ht[j] += qd * row[j];
            }
            n[d] = decay * n[d] + gain * kd;
            qn += qd * n[d];
        }
        const float denominator = fmaxf(fabsf(qn), expf(-m_new)) + eps;
        for (int64_t j = 0; j < dv; j++) ht[j] /= denominator;
        *m = m_new;
    }
}

void mlstm_steps_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                     int64_t v_stride, float *h, int64_t h_stride, const float *igate, int64_t i_stride,
                     const float *fgate, int64_t f_stride, const int64_t *starts, const int64_t *lengths, float *c,
                     float *n, float *m, int64_t requests, int64_t heads, int64_t dqk, int64_t dv, float eps,
                     int num_threads) {
    int64_t tokens = 0;
    for (int64_t r = 0; r < requests; r++) tokens += lengths[r];
    const int64_t work = tokens * heads * dqk * dv;
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (work >= PARALLEL_MIN_WORK)")
    for (int64_t task = 0; task < requests * heads; task++) {
        const int64_t r = task / heads, head = task % heads;
        if (lengths[r] == 0) continue;
        head_tokens(q + head * dqk, q_stride, k + head * dqk, k_stride, v + head * dv, v_stride, h + head * dv,
                    h_stride, igate + head, i_stride, fgate + head, f_stride, starts[r], lengths[r],
                    c + task * dqk * dv, n + task * dqk, m + task, dqk, dv, eps);
    }
}
