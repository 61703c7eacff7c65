/* W8A8 int8 linears for the CPU path: y = x @ w.T + bias where the checkpoint's own
 * forward quantizes x per token to int8 (compressed-tensors' dynamic symmetric token
 * scheme) and w is int8 codes times a per-tensor or per-output-channel scale.
 *
 * Two steps, each an OpenMP region:
 * 1. Each row of x is quantized as compressed-tensors does it in x's dtype:
 *    scale = max|x| / 127.5 (rounded to x's dtype; the dtype's epsilon where 0), code =
 *    round-half-even(clamp(x / scale rounded to x's dtype, -128, 127)). The codes, their
 *    row sums and the scales go to the caller's scratch.
 * 2. Integer products with AVX512_VNNI's vpdpbusd, which multiplies unsigned by signed
 *    bytes and adds groups of four products into int32 lanes. The weight codes become
 *    unsigned by adding 128 (w + 128 in 0..255) and x's codes stay signed, so
 *    sum((w + 128) x) - 128 sum(x) is the exact integer dot product. No lane can
 *    overflow while K < 65536 (|sum| <= K * 255 * 128 < 2^31; the launcher checks).
 *    Each thread takes tiles of NT weight rows and multiplies them by every block of MB
 *    rows of x, reducing the 16 lanes of NT accumulators at once.
 * out[m, n] = float(dot) * x_scale[m] * w_scale[n] (+ bias[n]), rounded to x's dtype
 * once: the float32 product of the dequantized x and w up to the order of the sums.
 *
 *    AVX2 builds without VNNI take vpmaddwd instead (int16 products summed in pairs
 *    into int32 lanes; see the AVX2 section below), for the decode shapes' few rows.
 *
 * Built for every target. quant_int8_kernel() says which step 2 this build has: 2
 * AVX512_VNNI (with AVX512BW/VL), 1 AVX2, 0 none; without one the launcher takes the
 * weight-only kernels over x dequantized from its codes, which int8_fake_quantize_rows
 * (every target) computes in one pass per row: the codes of step 1 times the row's
 * scale, rounded to x's dtype, as the checkpoint's own forward (activations.py's
 * fake_quantize_inputs) gives them, bit for bit.
 * x and out: float32 (kind 0) or bfloat16 (kind 1), rows contiguous.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

/* ---- Fake quantization (every target) ---- */

/* v rounded to x's dtype (bf16: to bfloat16 and back, NaN kept; float32: as it is). */
static inline vf to_dtype(vf v, int bf16) { return bf16 ? round_bf16_v(v) : v; }
static inline float to_dtype1(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* The code of x / scale (already rounded to x's dtype): clamped to [-128, 127] and
 * rounded half to even by the float32 magic number 1.5 * 2^23 (exact for |v| <= 2^22);
 * NaN stays NaN. */
static inline vf int8_code_v(vf v) {
    v = blend(v < -128.0f, splat(-128.0f), blend(v > 127.0f, splat(127.0f), v));
    return (v + 12582912.0f) - 12582912.0f;
}
static inline float int8_code1(float v) {
    v = v < -128.0f ? -128.0f : (v > 127.0f ? 127.0f : v);
    return (v + 12582912.0f) - 12582912.0f;
}

/* One row of K elements fake-quantized into out (x's dtype): scale = max|x| / 127.5 in
 * x's dtype (its epsilon where 0; NaN where any element is NaN, as torch's amax),
 * code = int8_code(x / scale in x's dtype), out = code * scale in x's dtype. */
static float row_scale(const void *row, int64_t K, int bf16) {
    vf amax = splat(0.0f);
    vi nan = (vi){0};
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        const vf v = loadv(row, k, bf16);
        nan |= v != v;
        amax = vmax(amax, blend(v < 0.0f, -v, v));
    }
    float largest = hmax(amax);
    int any_nan = 0;
    for (int lane = 0; lane < VL; lane++) any_nan |= nan[lane] != 0;
    for (; k < K; k++) {
        const float v = load1(row, k, bf16), magnitude = v < 0.0f ? -v : v;
        any_nan |= v != v;
        largest = magnitude > largest ? magnitude : largest;
    }
    const float scale = any_nan ? __builtin_nanf("") : to_dtype1(largest / 127.5f, bf16);
    return scale == 0.0f ? (bf16 ? 0.0078125f : 1.1920928955078125e-7f) : scale;  /* torch.finfo(dtype).eps */
}

static void fake_quantize_row(const void *row, int64_t K, int bf16, void *out) {
    const float scale = row_scale(row, K, bf16);
    int64_t k = 0;
    for (; k + VL <= K; k += VL)
        storev(out, k, to_dtype(int8_code_v(to_dtype(loadv(row, k, bf16) / scale, bf16)) * scale, bf16), bf16);
    for (; k < K; k++) {
        const float value = to_dtype1(int8_code1(to_dtype1(load1(row, k, bf16) / scale, bf16)) * scale, bf16);
        if (bf16) ((uint16_t *)out)[k] = f32_to_bf16(value);
        else ((float *)out)[k] = value;
    }
}

/* Below this many elements of x the row passes run on one thread. */
#define ROWS_PARALLEL_MIN (1 << 16)

/* x [rows, K] (rows x_stride elements apart) fake-quantized per row into out [rows, K]
 * contiguous, x's dtype (kind). */
void int8_fake_quantize_rows(const void *x, int64_t x_stride, int64_t rows, int64_t K, int kind, void *out,
                             int threads) {
    const size_t item = kind ? 2 : 4;
#pragma omp parallel for num_threads(threads) if (rows * K >= ROWS_PARALLEL_MIN) schedule(static)
    for (int64_t m = 0; m < rows; m++)
        fake_quantize_row((const char *)x + (size_t)m * (size_t)x_stride * item, K, kind,
                          (char *)out + (size_t)m * (size_t)K * item);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#define NT 4 /* weight rows per tile */
#define MB 6 /* rows of x per block */
#define PARALLEL_MIN_WORK (1 << 16)

int quant_int8_vnni(void) { return 1; }

/* float32 rounded to the nearest bfloat16 (ties to even), as a float32; NaN aside. */
static inline __m512 round_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32((int)0xffff0000u)));
}

static inline float round_bf16_scalar(float v) {
    float lanes[16];
    _mm512_storeu_ps(lanes, round_bf16(_mm512_set1_ps(v)));
    return lanes[0];
}

/* 16 elements of x from index k (mask: which are there) as float32. */
static inline __m512 load_x16(const void *row, int64_t k, __mmask16 mask, int bf16) {
    if (bf16) {
        const __m256i half = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)row + k);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)row + k);
}

static inline __mmask16 tail16(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

/* One row of x quantized (see the file comment): codes[K], its scale and code sum. */
static void quantize_row(const void *row, int64_t K, int bf16, int8_t *codes, float *scale, int32_t *code_sum) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_x16(row, k, tail16(K - k), bf16)));
    float s = _mm512_reduce_max_ps(amax) / 127.5f;
    if (bf16) s = round_bf16_scalar(s);
    if (s == 0.0f) s = bf16 ? 0.0078125f : 1.1920928955078125e-7f;  /* torch.finfo(dtype).eps */
    const __m512 divisor = _mm512_set1_ps(s), low = _mm512_set1_ps(-128.0f), high = _mm512_set1_ps(127.0f);
    __m512i sums = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = tail16(K - k);
        __m512 v = _mm512_div_ps(load_x16(row, k, mask, bf16), divisor);
        if (bf16) v = round_bf16(v);
        v = _mm512_roundscale_ps(_mm512_min_ps(_mm512_max_ps(v, low), high), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i q = _mm512_maskz_cvtps_epi32(mask, v);
        sums = _mm512_add_epi32(sums, q);
        _mm_mask_storeu_epi8(codes + k, mask, _mm512_cvtepi32_epi8(q));
    }
    *scale = s;
    *code_sum = _mm512_reduce_add_epi32(sums);
}

void int8_quantize_rows(const void *x, int64_t x_stride, int64_t rows, int64_t K, int kind, int8_t *codes,
                        float *scales, int32_t *code_sums, int threads) {
    const size_t item = kind ? 2 : 4;
#pragma omp parallel for num_threads(threads) if (rows * K >= PARALLEL_MIN_WORK) schedule(static)
    for (int64_t m = 0; m < rows; m++)
        quantize_row((const char *)x + (size_t)m * (size_t)x_stride * item, K, kind, codes + m * K, scales + m,
                     code_sums + m);
}

/* The 16 lanes of each of 4 accumulators summed: lane i of the result is acc[i]'s sum. */
static inline __m128i sum4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* acc += the products of u8 (unsigned bytes) and s8, four by four into int32 lanes. In
 * place through asm: GCC copies the intrinsic's accumulator to a new register (and
 * spills) on every step of a loop that keeps sixteen of them. */
#define DPBUSD(acc, u8, s8) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8))

/* The accumulators of one row of x against the NT weight rows, and one step of them:
 * 64 columns from k (mask: which are there). */
#define DOT_ROW(r) __m512i a##r##0 = _mm512_setzero_si512(), a##r##1 = a##r##0, a##r##2 = a##r##0, a##r##3 = a##r##0
#define DOT_STEP(r)                                                                     \
    do {                                                                                \
        const __m512i xv = _mm512_maskz_loadu_epi8(mask, x + (r) * K + k);             \
        DPBUSD(a##r##0, w0, xv);                                                 \
        DPBUSD(a##r##1, w1, xv);                                                 \
        DPBUSD(a##r##2, w2, xv);                                                 \
        DPBUSD(a##r##3, w3, xv);                                                 \
    } while (0)
#define LOAD_W(j) const __m512i w##j = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + (j) * K + k), flip)
#define DOT_STORE(r) _mm_storeu_si128((__m128i *)dots[r], sum4(a##r##0, a##r##1, a##r##2, a##r##3))

/* dots[r][j] = sum_k (w[j][k] + 128) * x[r][k] over the NT (4) weight rows and 6, 4, 2
 * or 1 rows of x (tile_dots6 .. tile_dots1). Each step prefetches the next tile's
 * weight rows in order: they follow these NT rows in memory, and a short row is too
 * short a stream for the hardware prefetcher (as in cpu_quant_bf16.c). */
#define ROWS6(X) X(0); X(1); X(2); X(3); X(4); X(5)
#define ROWS4(X) X(0); X(1); X(2); X(3)
#define ROWS2(X) X(0); X(1)
#define ROWS1(X) X(0)
#define TILE_DOTS(NAME, ROWS)                                                            \
    static void NAME(const int8_t *w, int64_t K, const int8_t *x, int32_t dots[MB][NT]) { \
        const __m512i flip = _mm512_set1_epi8((char)0x80);                                \
        const int8_t *next = w + NT * K;                                                  \
        ROWS(DOT_ROW);                                                                    \
        int64_t k = 0;                                                                    \
        for (const __mmask64 mask = ~(__mmask64)0; k + 64 <= K; k += 64) {                \
            for (int line = 0; line < NT; line++) __builtin_prefetch(next + NT * k + 64 * line); \
            LOAD_W(0); LOAD_W(1); LOAD_W(2); LOAD_W(3);                                   \
            ROWS(DOT_STEP);                                                               \
        }                                                                                 \
        if (k < K) {                                                                      \
            const __mmask64 mask = ((__mmask64)1 << (K - k)) - 1;                         \
            LOAD_W(0); LOAD_W(1); LOAD_W(2); LOAD_W(3);                                   \
            ROWS(DOT_STEP);                                                               \
        }                                                                                 \
        ROWS(DOT_STORE);                                                                  \
    }
TILE_DOTS(tile_dots6, ROWS6)
TILE_DOTS(tile_dots4, ROWS4)
TILE_DOTS(tile_dots2, ROWS2)
TILE_DOTS(tile_dots1, ROWS1)

typedef struct {
    const int8_t *codes;       /* [M, K] x's codes */
    const float *x_scales;     /* [M] */
    const int32_t *code_sums;  /* [M] */
    const int8_t *weight;      /* [N, K] */
    const float *w_scales;     /* [1] or [N] */
    int per_channel;
    const float *bias;         /* [N] or NULL */
    void *out;                 /* [M, N] rows out_stride apart, x's dtype */
    int64_t out_stride, M, N, K;
    int bf16;
} w8a8_problem;

/* out[m, n0 .. n0 + 4) for the block's rows from their dots, four outputs at a time
 * (masked past N); in the order of the file comment's formula. */
static void store_block(const w8a8_problem *p, int64_t n0, int64_t m0, int rows, int32_t dots[MB][NT]) {
    const __mmask8 mask = (__mmask8)(p->N - n0 >= NT ? 0xf : (1u << (p->N - n0)) - 1);
    const __m128 w_scale = p->per_channel ? _mm_maskz_loadu_ps(mask, p->w_scales + n0) : _mm_set1_ps(p->w_scales[0]);
    const __m128 bias = p->bias ? _mm_maskz_loadu_ps(mask, p->bias + n0) : _mm_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const int64_t m = m0 + r;
        const __m128i dot = _mm_sub_epi32(_mm_loadu_si128((const __m128i *)dots[r]),
                                          _mm_set1_epi32(128 * p->code_sums[m]));
        __m128 value = _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(dot), _mm_set1_ps(p->x_scales[m])), w_scale);
        if (p->bias) value = _mm_add_ps(value, bias);
        if (p->bf16) {  /* rounded to nearest even, as f32_to_bf16 */
            const __m128i bits = _mm_castps_si128(value);
            const __m128i odd = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
            __m128i rounded = _mm_srli_epi32(_mm_add_epi32(bits, _mm_add_epi32(odd, _mm_set1_epi32(0x7fff))), 16);
            rounded = _mm_mask_mov_epi32(rounded, _mm_cmp_ps_mask(value, value, _CMP_UNORD_Q),  /* NaN stays NaN */
                                         _mm_or_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(0x40)));
            _mm_mask_storeu_epi16((uint16_t *)p->out + m * p->out_stride + n0, mask, _mm_cvtepi32_epi16(rounded));
        } else {
            _mm_mask_storeu_ps((float *)p->out + m * p->out_stride + n0, mask, value);
        }
    }
}

/* Every row of x times weight rows [n0, n0 + NT) (rows past N read a zero tile). */
static void weight_tile(const w8a8_problem *p, int64_t n0, int8_t *zero_tile) {
    const int8_t *w = p->weight + n0 * p->K;
    if (n0 + NT > p->N) {  /* the last, partial tile: copy its rows beside zero rows */
        memset(zero_tile, 0, (size_t)(NT * p->K));
        memcpy(zero_tile, w, (size_t)((p->N - n0) * p->K));
        w = zero_tile;
    }
    int32_t dots[MB][NT];
    int64_t m0 = 0;
    for (; m0 + MB <= p->M; m0 += MB) {
        tile_dots6(w, p->K, p->codes + m0 * p->K, dots);
        store_block(p, n0, m0, MB, dots);
    }
    /* the last rows in blocks of 4, 2 and 1: each weight tile's codes shared by a block */
    for (int block = 4; block >= 1; block /= 2) {
        for (; m0 + block <= p->M; m0 += block) {
            const int8_t *x = p->codes + m0 * p->K;
            if (block == 4) tile_dots4(w, p->K, x, dots);
            else if (block == 2) tile_dots2(w, p->K, x, dots);
            else tile_dots1(w, p->K, x, dots);
            store_block(p, n0, m0, block, dots);
        }
    }
}

void w8a8_int8_linear(const int8_t *codes, const float *x_scales, const int32_t *code_sums, int64_t M,
                      const int8_t *weight, const float *w_scales, int per_channel, const float *bias, void *out,
                      int64_t out_stride, int64_t N, int64_t K, int kind, int threads, int16_t *scratch) {
    (void)scratch;  /* the AVX2 kernel's; this one reads x's int8 codes as they are */
    const w8a8_problem problem = {codes, x_scales, code_sums, weight, w_scales, per_channel, bias, out,
                                  out_stride, M, N, K, kind};
    const int64_t tiles = (N + NT - 1) / NT;
#pragma omp parallel num_threads(threads) if (M * N * K >= PARALLEL_MIN_WORK * 16)
    {
        int8_t *zero_tile = NULL;
        if ((N % NT) != 0) zero_tile = (int8_t *)malloc((size_t)(NT * K));
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) weight_tile(&problem, tile * NT, zero_tile);
        free(zero_tile);
    }
}

#else

int quant_int8_vnni(void) { return 0; }

/* One row of x quantized as step 1 says (codes[K], its scale and code sum), on any
 * target: row_scale and int8_code as fake_quantize_row; a NaN code (a row with a NaN
 * or infinite element, whose scale makes every output NaN anyway) is stored as 0. */
static void quantize_row(const void *row, int64_t K, int bf16, int8_t *codes, float *scale, int32_t *code_sum) {
    const float s = row_scale(row, K, bf16);
    vi sums = (vi){0};
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        vf code = int8_code_v(to_dtype(loadv(row, k, bf16) / s, bf16));
        const vi q = __builtin_convertvector(blend(code != code, splat(0.0f), code), vi);
        sums += q;
        for (int lane = 0; lane < VL; lane++) codes[k + lane] = (int8_t)q[lane];
    }
    int32_t sum = 0;
    for (int lane = 0; lane < VL; lane++) sum += sums[lane];
    for (; k < K; k++) {
        const float code = int8_code1(to_dtype1(load1(row, k, bf16) / s, bf16));
        codes[k] = code == code ? (int8_t)code : 0;
        sum += codes[k];
    }
    *scale = s;
    *code_sum = sum;
}

void int8_quantize_rows(const void *x, int64_t x_stride, int64_t rows, int64_t K, int kind, int8_t *codes,
                        float *scales, int32_t *code_sums, int threads) {
    const size_t item = kind ? 2 : 4;
#pragma omp parallel for num_threads(threads) if (rows * K >= ROWS_PARALLEL_MIN) schedule(static)
    for (int64_t m = 0; m < rows; m++)
        quantize_row((const char *)x + (size_t)m * (size_t)x_stride * item, K, kind, codes + m * K, scales + m,
                     code_sums + m);
}

#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)) && defined(__AVX2__)
#include <immintrin.h>

/* Step 2 on AVX2: x's codes widened to int16 once per call (into the launcher's scratch
 * of Kp = K rounded up to 16 per row, zero past K), each weight row's codes sign-extended to int16 as
 * they stream, and vpmaddwd's exact int32 sums of pairs of products (|sum| < 2^31 while
 * K < 65536: each pair's sum is at most 2^15). A weight row is multiplied by blocks of
 * up to AVX2_ROWS rows of x, which stay in the cache across the weight rows: the
 * launcher sends at most W8A8_AVX2_MAX_ROWS rows here (more take the weight-only
 * kernels' prefill panels, which reuse each weight row across many rows of x). */
#define AVX2_ROWS 4
#define PARALLEL_MIN_WORK (1 << 16)

int quant_int8_kernel(void) { return 1; }

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* dots[m] = sum_k w[k] * x[m][k] over mt rows of x (int16, Kp apart). The next weight
 * row follows this one in memory: prefetched as it goes (a row is too short a stream
 * for the hardware prefetcher to run ahead of). */
static inline __attribute__((always_inline)) void row_dots(const int8_t *w, const int16_t *x, int64_t Kp, int64_t K,
                                                           const int mt, int32_t dots[AVX2_ROWS]) {
    __m256i acc[AVX2_ROWS];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __builtin_prefetch(w + K + k);
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k)));
#pragma GCC unroll 4
        for (int m = 0; m < mt; m++)
            acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(wv, _mm256_loadu_si256((const __m256i *)(x + m * Kp + k))));
    }
    for (int m = 0; m < mt; m++) dots[m] = hsum_epi32(acc[m]);
    for (; k < K; k++)
        for (int m = 0; m < mt; m++) dots[m] += (int32_t)w[k] * x[m * Kp + k];
}

void w8a8_int8_linear(const int8_t *codes, const float *x_scales, const int32_t *code_sums, int64_t M,
                      const int8_t *weight, const float *w_scales, int per_channel, const float *bias, void *out,
                      int64_t out_stride, int64_t N, int64_t K, int kind, int threads, int16_t *x) {
    (void)code_sums;
    const int64_t Kp = (K + 15) / 16 * 16;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++) x[m * Kp + k] = codes[m * K + k];
        for (int64_t k = K; k < Kp; k++) x[m * Kp + k] = 0;
    }
#pragma omp parallel for num_threads(threads) if (M * N * K >= PARALLEL_MIN_WORK * 16) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *w = weight + n * K;
        const float w_scale = w_scales[per_channel ? n : 0], b = bias ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += AVX2_ROWS) {
            int32_t dots[AVX2_ROWS] = {0};
            const int16_t *xr = x + m0 * Kp;
            switch ((int)(M - m0 < AVX2_ROWS ? M - m0 : AVX2_ROWS)) {
            case 1: row_dots(w, xr, Kp, K, 1, dots); break;
            case 2: row_dots(w, xr, Kp, K, 2, dots); break;
            case 3: row_dots(w, xr, Kp, K, 3, dots); break;
            default: row_dots(w, xr, Kp, K, 4, dots); break;
            }
            for (int m = 0; m < AVX2_ROWS && m0 + m < M; m++) {
                /* in the order of the file comment's formula, as the VNNI kernel's store_block */
                float value = (float)dots[m] * x_scales[m0 + m] * w_scale;
                if (bias) value += b;
                const int64_t at = (m0 + m) * out_stride + n;
                if (kind) ((uint16_t *)out)[at] = f32_to_bf16(value);
                else ((float *)out)[at] = value;
            }
        }
    }
}

#elif !(defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__))

int quant_int8_kernel(void) { return 0; }

#else

int quant_int8_kernel(void) { return 2; }

#endif
