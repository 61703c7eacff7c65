/* Helpers shared by the engine's C kernels for the CPU path (kernels/native.py
 * builds each source with this directory on its include path). */
#ifndef SHARDLINE_CPU_COMMON_H
#define SHARDLINE_CPU_COMMON_H

#include <stdint.h>
#include <string.h>

/* The steps of exp_f32 below, as macros that also serve GCC vector types (lane by lane). */
#define EXP_F32_ROUND(x) (((x) * 1.44269504088896341f + 12582912.0f) - 12582912.0f)
#define EXP_F32_REMAINDER(x, n) (((x) - (n) * 0.693145751953125f) - (n) * 1.428606820309417232e-6f)
#define EXP_F32_SERIES(r) /* Horner's rule, degree 7 */ \
    ((((((((r) * (1.0f / 5040.0f) + 1.0f / 720.0f) * (r) + 1.0f / 120.0f) * (r) + 1.0f / 24.0f) * (r) \
       + 1.0f / 6.0f) * (r) + 0.5f) * (r) + 1.0f) * (r) + 1.0f)

/* exp(x) for float32 within about 2 ulp of expf: x = n ln2 + r with |r| <= ln2 / 2,
 * exp(r) by its Taylor series to degree 7 (remainder below 6e-9 relative), times
 * 2^n built in the exponent bits. Inputs below -87 (including -inf) return about
 * 1e-38 instead of 0, which the softmax cannot tell apart. */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* Round to nearest by the float32 magic number 1.5 * 2^23 (no libm call, so it
     * vectorizes); |x * log2(e)| < 2^22 after the clamp. */
    const float n = EXP_F32_ROUND(x);
    float p = EXP_F32_SERIES(EXP_F32_REMAINDER(x, n));
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

/* Element loads and stores: float32 and float64 as they are; bfloat16 (stored as its
 * 16 bits) widened to float32, and rounded back to nearest even on the way out. */
static inline float same_f32(float x) { return x; }
static inline double same_f64(double x) { return x; }
static inline float bf16_to_f32(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#endif
