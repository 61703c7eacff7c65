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
 * channel's state stays in registers through the request's tokens. Plain C, no
 * instruction-set intrinsics: the compiler vectorizes what the target allows. */
#include <math.h>
#include <stdint.h>

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
        const int64_t c1 = c0 + BLOCK < width ? c0 + BLOCK : width;
        const int keep = has_state[r] != 0;
        for (int64_t c = c0; c < c1; c++) {
            const int64_t s = r * width + c;
            float a = keep ? num[s] : 0.0f, b = keep ? den[s] : 0.0f, p = keep ? maxp[s] : FRESH_MAX;
            const float w = decay[c], u = first[c];
            for (int64_t t = cu_seqlens[r]; t < cu_seqlens[r + 1]; t++) {
                const float k = key[t * key_stride + c], v = value[t * value_stride + c];
                const float q = fmaxf(p, k + u);
                float e1 = expf(p - q), e2 = expf(k + u - q);
                out[t * out_stride + c] = (e1 * a + e2 * v) / (e1 * b + e2);
                const float q2 = fmaxf(p + w, k);
                e1 = expf(p + w - q2);
                e2 = expf(k - q2);
                a = e1 * a + e2 * v;
                b = e1 * b + e2;
                p = q2;
            }
            num[s] = a;
            den[s] = b;
            maxp[s] = p;
        }
    }
}
