/* The single-core multiply-add peak for bench/bench_small_linear.py: independent
 * chains of vector multiply-adds, as many as the target's registers hold beside two
 * operands, timed by the caller. Vectors of the build's widest width (GCC vector
 * extensions: zmm with AVX-512, ymm with AVX2, else pairs of xmm). */
#include <stdint.h>

#if defined(__AVX512F__)
#define VL 16
#define CHAINS 24
#else
#define VL 8
#define CHAINS 12
#endif

typedef float vf __attribute__((vector_size(4 * VL)));

/* Runs CHAINS x iterations multiply-adds of VL lanes; returns the float32 operations
 * done (2 per lane), and a sum the compiler cannot drop in *sink. */
double fma_peak_run(int64_t iterations, float *sink) {
    vf acc[CHAINS];
    const vf scale = (vf){0} + 0.999999f, step = (vf){0} + 1e-7f;
    for (int c = 0; c < CHAINS; c++) acc[c] = (vf){0} + (float)c;
    for (int64_t i = 0; i < iterations; i++) {
#pragma GCC unroll 24
        for (int c = 0; c < CHAINS; c++) acc[c] = acc[c] * scale + step;
    }
    float total = 0;
    for (int c = 0; c < CHAINS; c++)
        for (int lane = 0; lane < VL; lane++) total += acc[c][lane];
    *sink = total;
    return 2.0 * VL * CHAINS * (double)iterations;
}
