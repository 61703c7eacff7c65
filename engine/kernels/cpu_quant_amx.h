/* The register-blocked kernel's chunk products (cpu_quant_blocked.h) through AMX's
 * bfloat16 tile multiply, on builds and hosts with AMX-BF16. Part of cpu_quant_bf16.c
 * (included by cpu_quant_blocked.h; not a library of its own).
 *
 * A decoded panel (pairs of bfloat16 codes, NB output columns a row: the dot-product
 * pair order) is already AMX's layout of a B tile: 16 pairs x 16 columns, 64 bytes a
 * row. Each tile multiply takes up to 16 rows of x by 32 columns (the A tile, read from
 * x in place) against one B tile, so the products cost a few instructions per 512
 * weights and the kernel is left with decoding the codes, at any count of x's rows.
 * Products of bfloat16 values are exact and summed in float32 as the AVX512_BF16
 * instruction sums them (AMX takes subnormal inputs as zero and flushes subnormal
 * sums, 2^-126 and below).
 *
 * The kernel asks Linux for the tile registers once (arch_prctl ARCH_REQ_XCOMP_PERM);
 * where it refuses, or the chunk is not whole runs of 32 columns, the AVX512_BF16
 * products run instead. Each chunk loads its tile configuration (another library,
 * oneDNN, may have loaded its own on this thread in between) and releases the tiles.
 */
#ifndef SHARDLINE_CPU_QUANT_AMX_H
#define SHARDLINE_CPU_QUANT_AMX_H

#include "cpu_amx.h"  /* amx_ready, amx_load_config */

#if HAVE_AMX_BF16

#define AMX_ROWS 16  /* rows of x per tile multiply */

/* Tiles 0-3: the NV sums (rows x 16 float32); 4: x (rows x 32 bfloat16); 5, 6: panel. */
static void amx_configure(int rows) {
    const uint8_t r = (uint8_t)rows, tile_rows[7] = {r, r, r, r, r, 16, 16};
    const uint16_t tile_bytes[7] = {64, 64, 64, 64, 64, 64, 64};
    amx_load_config(7, tile_rows, tile_bytes);
}

/* out[m][n] (NB a row) = sum over the chunk's columns of x[m][k] * panel code (k, n),
 * for `rows` (<= 16) rows of x from x (at the chunk's first column), `columns` a
 * multiple of 32. */
static void amx_products(const uint32_t *panel, int64_t columns, const uint16_t *x, int64_t x_stride, int rows,
                         float *out) {
    amx_configure(rows);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t x_bytes = x_stride * (int64_t)sizeof(uint16_t), panel_bytes = NB * (int64_t)sizeof(uint32_t);
    for (int64_t c = 0; c < columns; c += 32) {
        const uint32_t *pairs = panel + c / 2 * NB;
        _tile_loadd(4, x + c, x_bytes);
        _tile_loadd(5, pairs, panel_bytes);
        _tile_loadd(6, pairs + 16, panel_bytes);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, pairs + 32, panel_bytes);
        _tile_loadd(6, pairs + 48, panel_bytes);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
    }
    const int64_t out_bytes = NB * (int64_t)sizeof(float);
    _tile_stored(0, out, out_bytes);
    _tile_stored(1, out + 16, out_bytes);
    _tile_stored(2, out + 32, out_bytes);
    _tile_stored(3, out + 48, out_bytes);
    _tile_release();
}

/* chunk_rows through the tiles; 0 (nothing added) where they do not take the chunk. */
static int amx_chunk_rows(const uint32_t *panel, int64_t k0, int64_t k1, const uint16_t *x, int64_t x_stride,
                          int64_t rows, const float *scale, const float *zero_scale, const float *x_sums,
                          int64_t sums_stride, float *sums) {
    _Static_assert(NB == 64, "four B tiles of 16 columns a panel");
    if ((k1 - k0) % 32 || !amx_ready()) return 0;
    float products[AMX_ROWS * NB] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < rows; m0 += AMX_ROWS) {
        const int count = (int)min64(rows - m0, AMX_ROWS);
        amx_products(panel, k1 - k0, x + m0 * x_stride + k0, x_stride, count, products);
        for (int m = 0; m < count; m++) {
            const float x_sum = zero_scale ? x_sums[(m0 + m) * sums_stride] : 0.0f;
            for (int v = 0; v < NV; v++) {
                float *to = sums + (m0 + m) * NB + 16 * v;
                __m512 total = _mm512_fmadd_ps(_mm512_load_ps(products + m * NB + 16 * v),
                                               _mm512_loadu_ps(scale + 16 * v), _mm512_load_ps(to));
                if (zero_scale)
                    total = _mm512_fnmadd_ps(_mm512_loadu_ps(zero_scale + 16 * v), _mm512_set1_ps(x_sum), total);
                _mm512_store_ps(to, total);
            }
        }
    }
    return 1;
}


/* ---- Few rows of x (the decode shapes): weight rows as the A tiles ----
 *
 * For 1-16 rows of x the weight is the tile multiply's A side, 16 weight rows by 32
 * columns a tile, decoded 64 codes at a time by byte tables (fp8_codes64's order:
 * the first tile holds columns 16 L + 0..7 of each 16, the second 16 L + 8..15), and
 * x the B side, its rows rearranged once per call into pairs in that column order. A
 * tile of 16 output columns (C: 16 weight rows x the rows of x) needs the codes
 * decoded once whatever the rows of x; float32 sums are scaled per block. */

/* int8 codes as fp8_codes64 decodes fp8: tables of |code|'s bfloat16 bytes, the sign
 * or-ed in, -128 (whose magnitude the 7-bit lookup cannot index) by a mask. */
static float int8_magnitude(int code) { return (float)code; }

static fp8_tables int8_byte_tables(void) { return byte_tables(int8_magnitude); }

static inline void int8_codes64(const uint8_t *p, const fp8_tables *tables, __m512i *first, __m512i *second) {
    const __m512i code = _mm512_loadu_si512(p), magnitude = _mm512_abs_epi8(code);
    __m512i high = _mm512_permutex2var_epi8(tables->high[0], magnitude, tables->high[1]);
    const __m512i low = _mm512_permutex2var_epi8(tables->low[0], magnitude, tables->low[1]);
    high = _mm512_ternarylogic_epi32(high, code, _mm512_set1_epi8((char)0x80), 0xf8);  /* | sign */
    high = _mm512_mask_mov_epi8(high, _mm512_cmpeq_epi8_mask(code, _mm512_set1_epi8((char)0x80)),
                                _mm512_set1_epi8((char)0xc3));  /* -128: 0xc300 */
    *first = _mm512_unpacklo_epi8(low, high);
    *second = _mm512_unpackhi_epi8(low, high);
}

/* x's rows [rows, K] as B tiles: per 64 columns, two tiles (the A tiles' column orders)
 * of 16 pairs x rows: pairs[((c / 64) * 2 + h) * 32 * rows + (2 j + i) * rows ...]. */
static void amx_x_pairs(const uint16_t *x, int64_t x_stride, int rows, int64_t K, uint16_t *pairs) {
    for (int64_t c = 0; c < K; c += 64)
        for (int h = 0; h < 2; h++) {
            uint16_t *tile = pairs + (c / 64 * 2 + h) * 32 * rows;
            for (int l = 0; l < 32; l++) {
                const int64_t column = c + 16 * (l / 8) + 8 * h + l % 8;
                for (int m = 0; m < rows; m++) tile[(l / 2) * 2 * rows + 2 * m + l % 2] = x[m * x_stride + column];
            }
        }
}

/* out[m][n0 + r] = sums[r][m] + bias, in bfloat16, for the tile's output columns
 * below N (a decode tile: 16 weight rows x `rows` rows of x). */
static void store_tile_sums(float sums[16][16], int64_t rows, int64_t n0, int64_t N, const float *bias,
                            uint16_t *out, int64_t out_stride) {
    for (int r = 0; r < 16 && n0 + r < N; r++)
        for (int64_t m = 0; m < rows; m++)
            out[m * out_stride + n0 + r] = f32_to_bf16(sums[r][m] + (bias ? bias[n0 + r] : 0.0f));
}

/* Tiles 0: sums (16 weight rows x rows float32), 1, 2: codes (16 x 32 bfloat16), 3, 4: x. */
static void amx_configure_decode(int rows) {
    const uint16_t b = (uint16_t)(4 * rows), tile_bytes[5] = {b, 64, 64, b, b};
    const uint8_t tile_rows[5] = {16, 16, 16, 16, 16};
    amx_load_config(5, tile_rows, tile_bytes);
}

/* Output columns n0 .. n0 + 15 for every row of x. */
static void amx_w8_tile(const uint8_t *weight, int fp8, const fp8_tables *tables, const float *scale,
                        int64_t scale_cols, int64_t bn, int64_t bk, const uint16_t *pairs, int rows, int64_t n0,
                        int64_t N, int64_t K, float sums[16][16]) {
    uint16_t codes[2][16 * 32] __attribute__((aligned(64)));
    float block[16][16] __attribute__((aligned(64)));
    memset(sums, 0, 16 * 16 * sizeof(float));
    for (int64_t k0 = 0, kb = 0; k0 < K; k0 += bk, kb++) {
        _tile_zero(0);
        for (int64_t c = k0; c < min64(K, k0 + bk); c += 64) {
            for (int r = 0; r < 16; r++) {
                const uint8_t *row = weight + min64(n0 + r, N - 1) * K + c;
                __builtin_prefetch(row + 16 * K);  /* the next tile's same columns */
                __m512i first, second;
                if (fp8) fp8_codes64(row, tables, (__m512bh *)&first, (__m512bh *)&second);
                else int8_codes64(row, tables, &first, &second);
                _mm512_store_si512(codes[0] + 32 * r, first);
                _mm512_store_si512(codes[1] + 32 * r, second);
            }
            const uint16_t *x_tiles = pairs + c / 64 * 2 * 32 * rows;
            _tile_loadd(1, codes[0], 64);
            _tile_loadd(2, codes[1], 64);
            _tile_loadd(3, x_tiles, 4 * rows);
            _tile_loadd(4, x_tiles + 32 * rows, 4 * rows);
            _tile_dpbf16ps(0, 1, 3);
            _tile_dpbf16ps(0, 2, 4);
        }
        _tile_stored(0, block, 64);
        for (int r = 0; r < 16; r++) {
            const float s = scale[min64(n0 + r, N - 1) / bn * scale_cols + kb];
            for (int m = 0; m < rows; m++) sums[r][m] += block[r][m] * s;
        }
    }
}

/* The decode shapes of an fp8 or int8 weight through the tiles; 0 (nothing written)
 * where they do not take the call: no AMX, K or a scale block not whole 64 columns. */
static int amx_w8_linear(const uint16_t *x, int64_t x_stride, int64_t rows, const uint8_t *weight, int fp8,
                         const float *scale, int64_t scale_cols, int64_t bn, int64_t bk, const float *bias,
                         uint16_t *out, int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    bk = min64(bk, K);
    if (rows > 16 || K % 64 || bk % 64 || !amx_ready()) return 0;
    uint16_t *pairs = aligned_alloc(64, (size_t)(K * rows) * sizeof(uint16_t) + 64);
    if (!pairs) return 0;
    amx_x_pairs(x, x_stride, (int)rows, K, pairs);
    const fp8_tables tables = fp8 ? fp8_byte_tables() : int8_byte_tables();
    _Pragma("omp parallel num_threads(num_threads) if (rows * N * K >= PARALLEL_MIN_WORK)")
    {
        amx_configure_decode((int)rows);
        _Pragma("omp for schedule(static)")
        for (int64_t n0 = 0; n0 < N; n0 += 16) {
            float sums[16][16];
            amx_w8_tile(weight, fp8, &tables, scale, scale_cols, bn, bk, pairs, (int)rows, n0, N, K, sums);
            store_tile_sums(sums, rows, n0, N, bias, out, out_stride);
        }
        _tile_release();
    }
    free(pairs);
    return 1;
}

/* ---- 4-bit weights: 64 packed bytes (128 columns) a row, two nibbles a byte ----
 * The low nibbles (even columns) and the high ones (odd columns) each give two A tiles
 * as fp8_codes64 orders 64 codes; x's B tiles follow (amx_w4_pairs). The codes are
 * bfloat16(code - 8) without zeros, bfloat16(code) with them (the zero enters as
 * zero * scale * the group's sum of x, as in w4_tile). */

/* The bfloat16 bytes of the 16 codes (less offset) as vpermb tables. */
static void w4_byte_tables(float offset, __m512i *high, __m512i *low) {
    uint8_t high_bytes[64], low_bytes[64];
    for (int i = 0; i < 64; i++) {
        const float value = (float)(i & 15) - offset;
        uint32_t bits;
        memcpy(&bits, &value, sizeof bits);
        high_bytes[i] = (uint8_t)(bits >> 24), low_bytes[i] = (uint8_t)(bits >> 16);
    }
    *high = _mm512_loadu_si512(high_bytes), *low = _mm512_loadu_si512(low_bytes);
}

/* x's rows as B tiles for 128-column steps: four a step (low nibbles' two orders, then
 * the high nibbles'), 16 pairs x rows each. */
static void amx_w4_pairs(const uint16_t *x, int64_t x_stride, int rows, int64_t K, uint16_t *pairs) {
    for (int64_t c = 0; c < K; c += 128)
        for (int t = 0; t < 4; t++) {
            uint16_t *tile = pairs + (c / 128 * 4 + t) * 32 * rows;
            for (int l = 0; l < 32; l++) {
                const int64_t column = c + 2 * (16 * (l / 8) + 8 * (t & 1) + l % 8) + t / 2;
                for (int m = 0; m < rows; m++) tile[(l / 2) * 2 * rows + 2 * m + l % 2] = x[m * x_stride + column];
            }
        }
}

/* One 128-column step of 16 weight rows: the four A tiles' codes, then their products. */
static inline void amx_w4_step(const uint8_t *packed, int64_t n0, int64_t N, int64_t K, int64_t c, __m512i high,
                               __m512i low, const uint16_t *x_tiles, int rows, uint16_t codes[4][16 * 32]) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int r = 0; r < 16; r++) {
        const uint8_t *row = packed + min64(n0 + r, N - 1) * (K / 2) + c / 2;
        __builtin_prefetch(row + 16 * (K / 2));
        const __m512i bytes = _mm512_loadu_si512(row);
        const __m512i halves[2] = {_mm512_and_si512(bytes, nibble),
                                   _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble)};
        for (int h = 0; h < 2; h++) {
            const __m512i hi = _mm512_permutexvar_epi8(halves[h], high), lo = _mm512_permutexvar_epi8(halves[h], low);
            _mm512_store_si512(codes[2 * h] + 32 * r, _mm512_unpacklo_epi8(lo, hi));
            _mm512_store_si512(codes[2 * h + 1] + 32 * r, _mm512_unpackhi_epi8(lo, hi));
        }
    }
    const int64_t x_bytes = 4 * rows;
    _tile_loadd(1, codes[0], 64);
    _tile_loadd(2, codes[1], 64);
    _tile_loadd(3, x_tiles, x_bytes);
    _tile_loadd(4, x_tiles + 32 * rows, x_bytes);
    _tile_dpbf16ps(0, 1, 3);
    _tile_dpbf16ps(0, 2, 4);
    _tile_loadd(1, codes[2], 64);
    _tile_loadd(2, codes[3], 64);
    _tile_loadd(3, x_tiles + 64 * rows, x_bytes);
    _tile_loadd(4, x_tiles + 96 * rows, x_bytes);
    _tile_dpbf16ps(0, 1, 3);
    _tile_dpbf16ps(0, 2, 4);
}

/* The decode shapes of a 4-bit weight through the tiles; 0 (nothing written) where
 * they do not take the call (no AMX, groups not whole 128 columns). x_sums: [rows,
 * K / group] scratch for the zero term. */
static int amx_w4_linear(const uint16_t *x, int64_t x_stride, int64_t rows, float *x_sums, const uint8_t *packed,
                         const float *scales, const float *zeros, int64_t group, const float *bias, uint16_t *out,
                         int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    if (rows > 16 || group % 128 || !amx_ready()) return 0;
    uint16_t *pairs = aligned_alloc(64, (size_t)(K * rows) * sizeof(uint16_t) + 64);
    if (!pairs) return 0;
    amx_w4_pairs(x, x_stride, (int)rows, K, pairs);
    if (zeros) group_sums(x, x_stride, rows, group, K, x_sums);
    __m512i high, low;
    w4_byte_tables(zeros ? 0.0f : 8.0f, &high, &low);
    const int64_t groups = K / group;
    _Pragma("omp parallel num_threads(num_threads) if (rows * N * K >= PARALLEL_MIN_WORK)")
    {
        amx_configure_decode((int)rows);
        uint16_t codes[4][16 * 32] __attribute__((aligned(64)));
        float block[16][16] __attribute__((aligned(64)));
        _Pragma("omp for schedule(static)")
        for (int64_t n0 = 0; n0 < N; n0 += 16) {
            float sums[16][16] = {{0}};
            for (int64_t g = 0; g < groups; g++) {
                _tile_zero(0);
                for (int64_t c = g * group; c < (g + 1) * group; c += 128)
                    amx_w4_step(packed, n0, N, K, c, high, low, pairs + c / 128 * 128 * rows, (int)rows, codes);
                _tile_stored(0, block, 64);
                for (int r = 0; r < 16; r++) {
                    const int64_t n = min64(n0 + r, N - 1);
                    const float s = scales[n * groups + g], zs = zeros ? zeros[n * groups + g] * s : 0.0f;
                    for (int64_t m = 0; m < rows; m++)
                        sums[r][m] += block[r][m] * s - (zeros ? zs * x_sums[m * groups + g] : 0.0f);
                }
            }
            store_tile_sums(sums, rows, n0, N, bias, out, out_stride);
        }
        _tile_release();
    }
    free(pairs);
    return 1;
}

#else

static int amx_chunk_rows(const uint32_t *panel, int64_t k0, int64_t k1, const uint16_t *x, int64_t x_stride,
                          int64_t rows, const float *scale, const float *zero_scale, const float *x_sums,
                          int64_t sums_stride, float *sums) {
    (void)panel, (void)k0, (void)k1, (void)x, (void)x_stride, (void)rows, (void)scale, (void)zero_scale;
    (void)x_sums, (void)sums_stride, (void)sums;
    return 0;
}

static int amx_w4_linear(const uint16_t *x, int64_t x_stride, int64_t rows, float *x_sums, const uint8_t *packed,
                         const float *scales, const float *zeros, int64_t group, const float *bias, uint16_t *out,
                         int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    (void)x, (void)x_stride, (void)rows, (void)x_sums, (void)packed, (void)scales, (void)zeros, (void)group;
    (void)bias, (void)out, (void)out_stride, (void)N, (void)K, (void)num_threads;
    return 0;
}

static int amx_w8_linear(const uint16_t *x, int64_t x_stride, int64_t rows, const uint8_t *weight, int fp8,
                         const float *scale, int64_t scale_cols, int64_t bn, int64_t bk, const float *bias,
                         uint16_t *out, int64_t out_stride, int64_t N, int64_t K, int num_threads) {
    (void)x, (void)x_stride, (void)rows, (void)weight, (void)fp8, (void)scale, (void)scale_cols, (void)bn;
    (void)bk, (void)bias, (void)out, (void)out_stride, (void)N, (void)K, (void)num_threads;
    return 0;
}

#endif

/* Whether the kernels take the AMX tiles here, and allowing them or not (tests). */
int quant_amx_ready(void) { return amx_ready(); }
void quant_amx_allow(int allowed) { __atomic_store_n(&amx_allowed, allowed, __ATOMIC_RELAXED); }

#endif
