/* RWKV-4's WKV recurrence over a packed batch on the CPU, float32: prefill chunks and
 * decode tokens alike. The arithmetic is rwkv_wkv.py's wkv_step (its plain-torch
 * reference, with wkv_varlen): per channel a numerator a, a denominator b and the
 * running maximum exponent p, a fresh request starting from a = b = 0, p = -1e38.
 *
 * Layout (the launcher, cpu_rwkv.py, asserts it): key, value, out [T, A] rows with
 * strides key_stride, value_stride, out_stride and unit channel stride; decay
 * (-exp(time_decay)) and first [A]; cu_seqlens [B+1]; has_state [B] (0 or 1);
 * num, den, maxp [B, A] contiguous, read where has_state and written after each
 * request's last token. Parallel over requests and blocks of BLOCK channels; each
 * block's states stay in local arrays through the request's tokens, its channels
 * side by side. Plain C and cpu_common.h's exp_f32 (within about 2 ulp of expf), no
 * instruction-set intrinsics: the compiler vectorizes what the target allows. */
#include <math.h>
#include <stdint.h>

#include "cpu_common.h"

#define BLOCK 64
#define PARALLEL_MIN_WORK (1 << 14)
#define FRESH_MAX (-1e38f)

void wkv_varlen_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride, float *out,
                    int64_t out_stride, const float *decay, const float *first, const int64_t *cu_seqlens,
                    const uint8_t *has_state, float *num, float *den, float *maxp, int64_t requests, int64_t width,
                    int num_threads) {
    const int64_t blocks = (width + BLOCK - 1) / BLOCK, work = cu_seqlens[requests] * width;
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (work >= PARALLEL_MIN_WORK)")
    for (int64_t task = 0; task < requests * blocks; task++) {
        const int64_t r = task / blocks, c0 = (task % blocks) * BLOCK;
        const int64_t n = c0 + BLOCK < width ? BLOCK : width - c0;
        const int keep = has_state[r] != 0;
        float a[BLOCK], b[BLOCK], p[BLOCK];
        for (int64_t i = 0; i < n; i++) {
            const int64_t s = r * width + c0 + i;
            a[i] = keep ? num[s] : 0.0f;
            b[i] = keep ? den[s] : 0.0f;
            p[i] = keep ? maxp[s] : FRESH_MAX;
        }
        const float *w = decay + c0, *u = first + c0;
        /* Tokens in order, the block's channels side by side (they vectorize). */
        for (int64_t t = cu_seqlens[r]; t < cu_seqlens[r + 1]; t++) {
            const float *k = key + t * key_stride + c0, *v = value + t * value_stride + c0;
            float *o = out + t * out_stride + c0;
            _Pragma("omp simd")
            for (int64_t i = 0; i < n; i++) {
                const float q = fmaxf(p[i], k[i] + u[i]);
                const float e1 = exp_f32(p[i] - q), e2 = exp_f32(k[i] + u[i] - q);
                o[i] = (e1 * a[i] + e2 * v[i]) / (e1 * b[i] + e2);
                const float q2 = fmaxf(p[i] + w[i], k[i]);
                const float f1 = exp_f32(p[i] + w[i] - q2), f2 = exp_f32(k[i] - q2);
                a[i] = f1 * a[i] + f2 * v[i];
                b[i] = f1 * b[i] + f2;
                p[i] = q2;
            }
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t s = r * width + c0 + i;
            num[s] = a[i];
            den[s] = b[i];
            maxp[s] = p[i];
        }
    }
}
