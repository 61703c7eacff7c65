/* Helpers shared by the engine's C kernels for the CPU path (kernels/native.py
 * builds each source with this directory on its include path). */
#ifndef SHARDLINE_CPU_COMMON_H
#define SHARDLINE_CPU_COMMON_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* float8_e4m3fn code -> float32, exactly: sign, 4 exponent bits (bias 7), 3 mantissa
 * bits; exponent 0 is subnormal (m * 2^-9); 0x7f and 0xff are NaN. Built from the
 * bits (no subnormal float arithmetic, so flush-to-zero modes do not change it). */
static inline float fp8_to_f32(uint8_t code) {
    const uint32_t magnitude = code & 0x7fu;
    uint32_t bits;
    if (magnitude == 0x7fu) {
        bits = 0x7fc00000u;
    } else if (magnitude < 8u) {
        const float value = (float)magnitude * (1.0f / 512.0f);
        memcpy(&bits, &value, sizeof bits);
    } else {
        bits = (magnitude << 20) + (120u << 23);
    }
    bits |= (uint32_t)(code & 0x80u) << 24;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

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

/* ---- Vectors of the target's width, as GCC vector extensions: VL float32 lanes, 16
 * with AVX-512 (zmm), 8 otherwise (AVX2's ymm; pairs of registers on NEON and SSE2).
 * kernels/native.py builds each source for one target, so VL is fixed per build. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif

typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));
typedef uint16_t vh __attribute__((vector_size(2 * VL)));

/* Element access to float32 or (bf16 != 0) bfloat16 tensors, as float32. The callers
 * pass bf16 as a constant, so each instance keeps one branch. */
static inline float load1(const void *base, int64_t index, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}

static inline vf loadv(const void *base, int64_t index, int bf16) {
    vf x;
    if (bf16) {
#if defined(__AVX512F__)  /* one widening load (GCC splits the generic one in two) */
        x = (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index))), 16);
#else
        vh half;
        memcpy(&half, (const uint16_t *)base + index, sizeof half);
        x = (vf)(__builtin_convertvector(half, vi) << 16);
#endif
    } else {
        memcpy(&x, (const float *)base + index, sizeof x);
    }
    return x;
}

/* f32_to_bf16 on VL lanes, each as its bfloat16 bits in the high half of a 32-bit lane
 * (the low half zero): round to nearest even in integer arithmetic, NaN kept quiet.
 * Not AVX512_BF16's conversion instruction: it flushes subnormals to zero, where
 * torch's bfloat16 keeps them. */
typedef uint32_t vu __attribute__((vector_size(4 * VL)));
static inline vu bf16_bits_v(vf x) {
    const vu bits = (vu)x;
    const vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const vu nan = (vu)((bits & 0x7fffffffu) > 0x7f800000u);
    return (nan & ((bits & 0xffff0000u) | 0x400000u)) | (~nan & rounded);
}

/* x rounded to bfloat16 and widened back, lane by lane (round_bf16 on vectors). */
static inline vf round_bf16_v(vf x) { return (vf)bf16_bits_v(x); }

static inline void storev(void *base, int64_t index, vf x, int bf16) {
    if (bf16) {
#if defined(__AVX512F__)  /* one narrowing store */
        _mm256_storeu_si256((__m256i *)((uint16_t *)base + index), _mm512_cvtepi32_epi16((__m512i)(bf16_bits_v(x) >> 16)));
#else
        const vh half = __builtin_convertvector(bf16_bits_v(x) >> 16, vh);
        memcpy((uint16_t *)base + index, &half, sizeof half);
#endif
    } else {
        memcpy((float *)base + index, &x, sizeof x);
    }
}

/* DOT_BF16: AVX512_BF16's dot-product instruction is there (the build's target has
 * it): each float32 lane adds the two products of a pair of bfloat16 lanes (exact in
 * float32) to its sum, 2 VL elements per instruction, without widening either side.
 * It treats subnormal bfloat16 inputs (below 1.2e-38) as zero. */
#if defined(__AVX512BF16__) && VL == 16
#define DOT_BF16 1
static inline vf dot_bf16(vf sum, vf pairs_a, vf pairs_b) {
    return (vf)_mm512_dpbf16_ps((__m512)sum, (__m512bh)pairs_a, (__m512bh)pairs_b);
}
#else
#define DOT_BF16 0
#endif

static inline vf splat(float x) { return (vf){0} + x; }
static inline vf blend(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vf vmax(vf a, vf b) { return blend(a > b, a, b); }

/* Lanes of x in the given order (GCC before 12 has only __builtin_shuffle). */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
#else
#define SHUFFLE(x, ...) __builtin_shuffle(x, (vi){__VA_ARGS__})
#endif

/* A horizontal reduction: log2(VL) steps, each combining lanes half as far apart. */
#if VL == 16
#define LANE_INDICES {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#define REDUCE(x, OP)                                                                       \
    x = OP(x, SHUFFLE(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));            \
    x = OP(x, SHUFFLE(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));            \
    x = OP(x, SHUFFLE(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));            \
    x = OP(x, SHUFFLE(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14))
#else
#define LANE_INDICES {0, 1, 2, 3, 4, 5, 6, 7}
#define REDUCE(x, OP)                                                                       \
    x = OP(x, SHUFFLE(x, 4, 5, 6, 7, 0, 1, 2, 3));                                          \
    x = OP(x, SHUFFLE(x, 2, 3, 0, 1, 6, 7, 4, 5));                                          \
    x = OP(x, SHUFFLE(x, 1, 0, 3, 2, 5, 4, 7, 6))
#endif
static inline vf vadd(vf a, vf b) { return a + b; }
static inline float hmax(vf x) { REDUCE(x, vmax); return x[0]; }
static inline float hsum(vf x) { REDUCE(x, vadd); return x[0]; }

/* exp_f32 (cpu_common.h) on VL lanes, except that below -87 (and -inf: masked keys)
 * it gives exactly 0. */
static inline vf vexp(vf x) {
    const vi underflow = x < -87.0f;
    x = blend(x > 88.0f, splat(88.0f), x);
    x = blend(underflow, splat(-87.0f), x);
    const vf n = EXP_F32_ROUND(x);
    const vf p = EXP_F32_SERIES(EXP_F32_REMAINDER(x, n));
    const vi bits = (vi)p + __builtin_convertvector(n, vi) * (1 << 23);
    return blend(underflow, splat(0.0f), (vf)bits);
}

/* tanh on VL lanes, as 1 - 2 / (exp(2x) + 1): within about 1e-7 of tanhf, and
 * exactly +-1 where exp(2x) leaves vexp's range. */
static inline vf vtanh(vf x) { return 1.0f - 2.0f / (vexp(2.0f * x) + 1.0f); }

/* Two-vector shuffle: lanes of the concatenation x:y (x's are 0 .. VL - 1). */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE2(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define SHUFFLE2(x, y, ...) __builtin_shuffle(x, y, (vi){__VA_ARGS__})
#endif

/* Interleaving the first or second halves of two vectors: x0 y0 x1 y1 ... */
#if VL == 16
#define ZIP_LOW 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23
#define ZIP_HIGH 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31
#else
#define ZIP_LOW 0, 8, 1, 9, 2, 10, 3, 11
#define ZIP_HIGH 4, 12, 5, 13, 6, 14, 7, 15
#endif

/* Transposes the VL x VL matrix whose rows are x[0 .. VL - 1], in place: log2(VL)
 * rounds, each interleaving row i with row i + VL / 2 into rows 2i and 2i + 1. */
static inline __attribute__((always_inline)) void transpose(vf x[VL]) {
    for (int round = 1; round < VL; round *= 2) {
        vf zipped[VL];
        for (int i = 0; i < VL / 2; i++) {
            zipped[2 * i] = SHUFFLE2(x[i], x[i + VL / 2], ZIP_LOW);
            zipped[2 * i + 1] = SHUFFLE2(x[i], x[i + VL / 2], ZIP_HIGH);
        }
        for (int i = 0; i < VL; i++) x[i] = zipped[i];
    }
}

/* sum_each below: pairs of lanes within each quarter of 4 (a 128-bit lane on x86, so
 * one in-lane shuffle each), then pairs of quarters. */
#if VL == 16
#define EVEN_LANES 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30
#define ODD_LANES 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31
#define EVEN_QUARTERS 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define ODD_QUARTERS 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#else
#define EVEN_LANES 0, 2, 8, 10, 4, 6, 12, 14
#define ODD_LANES 1, 3, 9, 11, 5, 7, 13, 15
#define EVEN_QUARTERS 0, 1, 2, 3, 8, 9, 10, 11
#define ODD_QUARTERS 4, 5, 6, 7, 12, 13, 14, 15
#endif
static inline vf pair_lanes(vf x, vf y) { return SHUFFLE2(x, y, EVEN_LANES) + SHUFFLE2(x, y, ODD_LANES); }
static inline vf pair_quarters(vf x, vf y) { return SHUFFLE2(x, y, EVEN_QUARTERS) + SHUFFLE2(x, y, ODD_QUARTERS); }

/* The sums of VL vectors, each one's lanes added: lane j of the result is the sum of
 * a[j]'s lanes. VL - 1 pair steps, where one horizontal sum per vector takes log2(VL)
 * and leaves VL scalars. */
static inline __attribute__((always_inline)) vf sum_each(const vf a[VL]) {
    vf quarters[VL / 4];  /* quarter q of quarters[k]: a[4k .. 4k + 3]'s sums over quarter q */
    for (int k = 0; k < VL / 4; k++)
        quarters[k] = pair_lanes(pair_lanes(a[4 * k], a[4 * k + 1]), pair_lanes(a[4 * k + 2], a[4 * k + 3]));
#if VL == 16
    return pair_quarters(pair_quarters(quarters[0], quarters[1]), pair_quarters(quarters[2], quarters[3]));
#else
    return pair_quarters(quarters[0], quarters[1]);
#endif
}

#endif
