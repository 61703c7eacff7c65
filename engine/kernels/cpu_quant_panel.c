/* Prefill panels in oneDNN's blocked weight layout (the launcher is
 * kernels/cpu_quant_panel.py).
 *
 * A quantized linear's prefill multiplies panels of its weight rows, dequantized to x's
 * dtype, by many rows of x. oneDNN's matmul reads its weight in a blocked layout and
 * reorders a plain one on every call; a packed linear (engine/cpu/linear.py) pays that
 * once at load. Here each panel is dequantized straight into the buffer of a packed
 * weight the launcher keeps, so the matmul runs as on a packed weight.
 *
 *   w8_to_blocked / w4_to_blocked: rows n0 .. n1 of a quantized weight (the layouts of
 *   cpu_quant.c) dequantized straight into the blocked layout, each value computed as
 *   cpu_quant.c's panels compute it (code times scale, W4 less its zero point first,
 *   in float32) and rounded to the panel's dtype once (bfloat16: to nearest even).
 *   An int8 W8 weight may carry a zero point per row (asymmetric int8): the code less
 *   it, subtracted in integers (exact), times the scale.
 *   A tile of 16 rows x 16 units is dequantized in registers and transposed there: on
 *   AVX-512 builds for float32 and bfloat16 panels, on AVX2 builds for float32 ones
 *   (as four 8 x 8 transposes); elsewhere (and at ragged edges) element by element.
 *
 *   Layout (found and checked by the launcher, per panel shape and dtype): the
 *   weight's elements taken in units of 4 bytes (a pair of bfloat16 columns, or one
 *   float32 column), rows grouped in blocks of block_rows:
 *       blocked[(r / block_rows) * padded_units * block_rows + u * block_rows + r % block_rows]
 *           = unit u of row r (columns 2u, 2u + 1 in bfloat16; column u in float32)
 *   units = K's bytes / 4; padded_units >= units (the columns oneDNN pads to), and
 *   rows beyond the panel's up to a whole block: both stay as the launcher zeroed them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#define TILE 16
/* At most this many tiles of rows are dequantized side by side (see to_blocked). */
#define GROUP_TILES 4

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---- Dequantizing into the blocked layout ---- */

/* Where the blocked layout holds a panel's rows and units (see the top of the file). */
typedef struct {
    uint32_t *blocked;
    int64_t block_rows, padded_units;
    int bf16;  /* 1: a unit is two bfloat16 columns; 0: one float32 column */
} blocked_panel;

static inline void store_element(const blocked_panel *panel, int64_t r, int64_t k, float value) {
    const int64_t unit = panel->bf16 ? k / 2 : k;
    uint32_t *at = panel->blocked + r / panel->block_rows * panel->padded_units * panel->block_rows
                   + unit * panel->block_rows + r % panel->block_rows;
    if (panel->bf16) ((uint16_t *)at)[k & 1] = f32_to_bf16(value);
    else memcpy(at, &value, sizeof value);
}

/* Which scale of a W8 row covers column k, and the W4 group's; ``zero``: an int8
 * row's zero point (0 for fp8 and symmetric int8). */
static inline float w8_element(const uint8_t *row, const float *scale_row, int32_t zero, int64_t bk, int64_t k,
                               int fp8) {
    const float code = fp8 ? fp8_to_f32(row[k]) : (float)((int32_t)(int8_t)row[k] - zero);
    return code * scale_row[k / bk];
}

static inline float w4_element(const uint8_t *row, const float *scale_row, const float *zero_row, int64_t group,
                               int64_t k) {
    const uint8_t byte = row[k / 2];
    const float zero = zero_row ? zero_row[k / group] : 8.0f;
    return ((float)((k & 1) ? byte >> 4 : byte & 15) - zero) * scale_row[k / group];
}

/* What a quantized weight row is; the W8 or W4 fields are used. */
typedef struct {
    const uint8_t *codes;  /* W8 [N, K] bytes or W4 [N, K / 2] */
    const float *scales, *zeros;
    const int8_t *w8_zeros;      /* W8 int8: a zero point per row [N], or NULL (none) */
    int64_t scale_cols, bn, bk;  /* W8: scale [ceil(N / bn), scale_cols], bk columns each */
    int64_t group;               /* W4: scales, zeros [N, K / group]; 0 for W8 */
    int fp8;
} quantized_rows;

/* A tile's rows: codes, the scale (and W4 zero) rows and the W8 zero points, found
 * once per tile. */
typedef struct {
    const uint8_t *codes[TILE];
    const float *scales[TILE], *zeros[TILE];
    int32_t w8_zeros[TILE];
} tile_rows;

/* VECTOR_TILES: which panel dtypes this build dequantizes in vector tiles, as bits. */
#define TILES_FLOAT32 1
#define TILES_BFLOAT16 2

#if defined(__AVX512F__)
#define VECTOR_TILES (TILES_FLOAT32 | TILES_BFLOAT16)
/* 16 rows of 16 units (r[i]: row i) transposed into 16 runs of 16 (at dst,
 * dst_stride apart): the usual unpack / lane-shuffle sequence. */
static inline void transpose16_registers(__m512i r[16], uint32_t *dst, int64_t dst_stride) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4q + j] holds, per 128-bit lane L, units 4L + j' of rows 4q .. 4q + 3. */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        const __m512i lanes02 = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        const __m512i lanes13 = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        const __m512i lanes02b = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        const __m512i lanes13b = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
        _mm512_storeu_si512((void *)(dst + (i + 0) * dst_stride), lanes02);
        _mm512_storeu_si512((void *)(dst + (i + 8) * dst_stride), lanes13);
        _mm512_storeu_si512((void *)(dst + (i + 4) * dst_stride), lanes02b);
        _mm512_storeu_si512((void *)(dst + (i + 12) * dst_stride), lanes13b);
    }
}

/* 16 codes at p as float32 lanes (int8 codes less ``zero``, in integers). */
static inline __m512 w8_codes16(const uint8_t *p, int fp8, int32_t zero) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    if (!fp8) return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepi8_epi32(bytes), _mm512_set1_epi32(zero)));
    const vi code = (vi)_mm512_cvtepu8_epi32(bytes);
    const vi magnitude = code & 0x7f;
    const vf subnormal = __builtin_convertvector(magnitude, vf) * (1.0f / 512.0f);
    vi bits = (vi)blend(magnitude < 8, subnormal, (vf)((magnitude << 20) + (120 << 23)));
    bits = (vi)blend(magnitude == 0x7f, (vf)((vi){0} + 0x7fc00000), (vf)bits);
    return (__m512)(bits | ((code & 0x80) << 24));
}

/* Two runs of 16 float32 values (columns 2u .. 2u + 31 as lo = even, hi = odd, or as
 * first = 0 .. 15, second = 16 .. 31) as 16 units of bfloat16 pairs. */
static inline __m512i bf16_units_from_pairs(vf even, vf odd) {
    return (__m512i)((bf16_bits_v(odd)) | (bf16_bits_v(even) >> 16));
}
static inline __m512i bf16_units_from_runs(vf first, vf second) {
    const __m256i low = _mm512_cvtepi32_epi16((__m512i)(bf16_bits_v(first) >> 16));
    const __m256i high = _mm512_cvtepi32_epi16((__m512i)(bf16_bits_v(second) >> 16));
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

/* Scales at least this large keep every nonzero W8 value (a code of magnitude at
 * least 2^-9 times the scale) a normal float, where AVX512_BF16's conversion (which
 * flushes subnormals) rounds exactly as bf16_bits_v does: to nearest even, NaN quiet. */
#define NORMAL_SCALE 0x1p-116f

/* 16 units of a W8 row from column k (within one scale block); ``normal``: the scale
 * is at least NORMAL_SCALE. */
static inline __m512i w8_units(const uint8_t *row, float scale, int32_t zero, int64_t k, int fp8, int bf16,
                               int normal) {
    const vf first = (vf)w8_codes16(row + k, fp8, zero) * scale;
    if (!bf16) return (__m512i)first;
    const vf second = (vf)w8_codes16(row + k + 16, fp8, zero) * scale;
#if defined(__AVX512BF16__)
    if (normal) return (__m512i)_mm512_cvtne2ps_pbh((__m512)second, (__m512)first);
#else
    (void)normal;
#endif
    return bf16_units_from_runs(first, second);
}

/* 16 units of a W4 row from column k (within one group). */
static inline __m512i w4_units(const uint8_t *row, float scale, float zero, int64_t k, int bf16) {
    if (bf16) {  /* 16 bytes: byte j's low nibble is column 2j, its high nibble 2j + 1 */
        const vi bytes = (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k / 2)));
        const vf even = (__builtin_convertvector(bytes & 15, vf) - zero) * scale;
        const vf odd = (__builtin_convertvector(bytes >> 4, vf) - zero) * scale;
        return bf16_units_from_pairs(even, odd);
    }
    uint8_t spread[16];  /* 8 bytes -> 16 columns, low nibble first */
    for (int j = 0; j < 8; j++) {
        spread[2 * j] = row[k / 2 + j] & 15;
        spread[2 * j + 1] = row[k / 2 + j] >> 4;
    }
    const vi codes = (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)spread));
    return (__m512i)((__builtin_convertvector(codes, vf) - zero) * scale);
}


/* Rows r0 .. r0 + TILE of the panel, units u0 .. u0 + TILE, in registers. */
static void vector_tile(const quantized_rows *q, const tile_rows *rows, int64_t r0, int64_t u0,
                        const blocked_panel *panel) {
    __m512i units[TILE];
    const int per_unit = panel->bf16 ? 2 : 1;
    const int64_t k = u0 * per_unit, column = k / (q->group ? q->group : q->bk);
    const int64_t ahead = (q->group ? k / 2 : k) + 256;  /* bytes: the row's stream, prefetched */
    for (int i = 0; i < TILE; i++) {
        const float scale = rows->scales[i][column];
        const int32_t zero = rows->w8_zeros[i];
        __builtin_prefetch(rows->codes[i] + ahead, 0, 3);
        if (q->group)
            units[i] = w4_units(rows->codes[i], scale, rows->zeros[i] ? rows->zeros[i][column] : 8.0f, k,
                                panel->bf16);
        else if (fabsf(scale) >= NORMAL_SCALE)
            units[i] = q->fp8 ? w8_units(rows->codes[i], scale, zero, k, 1, panel->bf16, 1)
                              : w8_units(rows->codes[i], scale, zero, k, 0, panel->bf16, 1);
        else
            units[i] = w8_units(rows->codes[i], scale, zero, k, q->fp8, panel->bf16, 0);
    }
    transpose16_registers(units, panel->blocked + r0 / panel->block_rows * panel->padded_units * panel->block_rows
                            + u0 * panel->block_rows + r0 % panel->block_rows, panel->block_rows);
}

#elif defined(__AVX2__)
#include <immintrin.h>
/* float32 panels only: oneDNN packs bfloat16 on few AVX2 hosts (AVX-NE-CONVERT), whose
 * bfloat16 panels are filled element by element. */
#define VECTOR_TILES TILES_FLOAT32

/* 8 rows of 8 units (r[i]: row i) transposed into 8 runs of 8 rows (at dst,
 * dst_stride apart): pairs interleaved, then quads, then the 128-bit halves. */
static inline void transpose8_registers(const __m256 r[8], uint32_t *dst, int64_t dst_stride) {
    __m256 t[8], s[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      /* units 0, 1 | 4, 5 of rows i, i + 1 */
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  /* units 2, 3 | 6, 7 */
    }
    for (int i = 0; i < 8; i += 4) {  /* s[i + j]: unit j | j + 4 of rows i .. i + 3 */
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps((float *)(dst + j * dst_stride), _mm256_permute2f128_ps(s[j], s[j + 4], 0x20));
        _mm256_storeu_ps((float *)(dst + (j + 4) * dst_stride), _mm256_permute2f128_ps(s[j], s[j + 4], 0x31));
    }
}

/* 8 W8 values of a row from column k: codes (int8 ones less ``zero``, in integers) as
 * float32, times the scale. */
static inline __m256 w8_values8(const uint8_t *row, int64_t k, float scale, int32_t zero, int fp8) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(row + k));
    if (!fp8) {
        const __m256i codes = _mm256_sub_epi32(_mm256_cvtepi8_epi32(bytes), _mm256_set1_epi32(zero));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(codes), _mm256_set1_ps(scale));
    }
    const vi code = (vi)_mm256_cvtepu8_epi32(bytes);
    const vi magnitude = code & 0x7f;
    const vf subnormal = __builtin_convertvector(magnitude, vf) * (1.0f / 512.0f);
    vi bits = (vi)blend(magnitude < 8, subnormal, (vf)((magnitude << 20) + (120 << 23)));
    bits = (vi)blend(magnitude == 0x7f, (vf)((vi){0} + 0x7fc00000), (vf)bits);
    return (__m256)((vf)(bits | ((code & 0x80) << 24)) * scale);
}

/* 8 W4 values of a row from column k (even): byte j's low nibble is column 2j, its
 * high nibble 2j + 1; less the zero point, times the scale. */
static inline __m256 w4_values8(const uint8_t *row, int64_t k, float scale, float zero) {
    int32_t four;
    memcpy(&four, row + k / 2, sizeof four);
    const __m128i bytes = _mm_cvtsi32_si128(four);
    const __m256i twice = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));  /* b0 b0 b1 b1 .. */
    const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi32(twice, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)),
                                             _mm256_set1_epi32(15));
    return (__m256)((__builtin_convertvector((vi)nibbles, vf) - zero) * scale);
}

/* 8 rows (from tile row h) of 8 units (from column k), W8 codes of one kind. */
static inline void w8_rows8(const tile_rows *rows, int h, int64_t k, int64_t column, int fp8, __m256 values[8]) {
    for (int i = 0; i < 8; i++)
        values[i] = w8_values8(rows->codes[h + i], k, rows->scales[h + i][column], rows->w8_zeros[h + i], fp8);
}

/* Rows r0 .. r0 + TILE of a float32 panel, units u0 .. u0 + TILE, in registers: four
 * 8 x 8 transposes. */
static void vector_tile(const quantized_rows *q, const tile_rows *rows, int64_t r0, int64_t u0,
                        const blocked_panel *panel) {
    const int64_t k0 = u0, column = k0 / (q->group ? q->group : q->bk);
    const int64_t ahead = (q->group ? k0 / 2 : k0) + 256;  /* bytes: the row's stream, prefetched */
    uint32_t *dst = panel->blocked + r0 / panel->block_rows * panel->padded_units * panel->block_rows
                    + u0 * panel->block_rows + r0 % panel->block_rows;
    for (int i = 0; i < TILE; i++) __builtin_prefetch(rows->codes[i] + ahead, 0, 3);
    for (int h = 0; h < TILE; h += 8)
        for (int c = 0; c < TILE; c += 8) {
            __m256 values[8];
            const int64_t k = k0 + c;
            if (q->group) {
                for (int i = 0; i < 8; i++) {
                    const float *zeros = rows->zeros[h + i];
                    values[i] = w4_values8(rows->codes[h + i], k, rows->scales[h + i][column],
                                           zeros ? zeros[column] : 8.0f);
                }
            } else if (q->fp8) {
                w8_rows8(rows, h, k, column, 1, values);
            } else {
                w8_rows8(rows, h, k, column, 0, values);
            }
            transpose8_registers(values, dst + c * panel->block_rows + h, panel->block_rows);
        }
}

#else
#define VECTOR_TILES 0
#endif


static void find_rows(const quantized_rows *q, int64_t n, int64_t count, int64_t K, tile_rows *rows) {
    for (int64_t i = 0; i < count; i++, n++) {
        if (q->group) {
            rows->codes[i] = q->codes + n * (K / 2);
            rows->scales[i] = q->scales + n * (K / q->group);
            rows->zeros[i] = q->zeros ? q->zeros + n * (K / q->group) : NULL;
            rows->w8_zeros[i] = 0;
        } else {
            rows->codes[i] = q->codes + n * K;
            rows->scales[i] = q->scales + n / q->bn * q->scale_cols;
            rows->zeros[i] = NULL;
            rows->w8_zeros[i] = q->w8_zeros && !q->fp8 ? q->w8_zeros[n] : 0;
        }
    }
}

/* Rows r0 .. r1 of the panel (weight rows n0 + r0 ..), columns of units u0 .. u1. */
static void dequantize_tile(const quantized_rows *q, const tile_rows *rows, int64_t r0, int64_t r1, int64_t u0,
                            int64_t u1, const blocked_panel *panel, int vectors) {
    const int per_unit = panel->bf16 ? 2 : 1;
#if VECTOR_TILES
    if (vectors && r1 - r0 == TILE && u1 - u0 == TILE) {
        vector_tile(q, rows, r0, u0, panel);
        return;
    }
#else
    (void)vectors;
#endif
    for (int64_t r = r0; r < r1; r++)
        for (int64_t k = u0 * per_unit; k < u1 * per_unit; k++) {
            const int i = (int)(r - r0);
            const float value = q->group ? w4_element(rows->codes[i], rows->scales[i], rows->zeros[i], q->group, k)
                                         : w8_element(rows->codes[i], rows->scales[i], rows->w8_zeros[i], q->bk,
                                                      k, q->fp8);
            store_element(panel, r, k, value);
        }
}

/* Whether a run of TILE units never crosses a scale block or group (the vector tiles
 * take one scale per row): runs start at multiples of TILE units. */
static int runs_within_scales(const quantized_rows *q, int64_t K, int per_unit) {
    const int64_t run = TILE * per_unit, span = q->group ? q->group : q->bk;
    return span % run == 0 || (!q->group && span >= K);
}

static void to_blocked(const quantized_rows *q, int64_t n0, int64_t n1, int64_t K, int bf16, int64_t block_rows,
                       int64_t padded_units, uint32_t *blocked, int num_threads) {
    const blocked_panel panel = {blocked, block_rows, padded_units, bf16};
    const int per_unit = bf16 ? 2 : 1;
    const int64_t rows = n1 - n0, units = K / per_unit, tiles = (rows + TILE - 1) / TILE;
    const int vectors = (VECTOR_TILES & (bf16 ? TILES_BFLOAT16 : TILES_FLOAT32)) && runs_within_scales(q, K, per_unit)
                        && block_rows % TILE == 0;
    /* The tiles of a block's rows (up to GROUP_TILES) go unit by unit together, so the
     * panel is written in runs of whole blocks' units, in order. */
    const int64_t group = block_rows % TILE == 0 && block_rows / TILE <= GROUP_TILES ? block_rows / TILE : 1;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t g = 0; g < tiles; g += group) {
        tile_rows found[GROUP_TILES];
        const int64_t count = min64(group, tiles - g);
        for (int64_t t = 0; t < count; t++)
            find_rows(q, n0 + (g + t) * TILE, min64(rows, (g + t + 1) * TILE) - (g + t) * TILE, K, &found[t]);
        for (int64_t u0 = 0; u0 < units; u0 += TILE)
            for (int64_t t = 0; t < count; t++) {
                const int64_t r0 = (g + t) * TILE;
                dequantize_tile(q, &found[t], r0, min64(rows, r0 + TILE), u0, min64(units, u0 + TILE), &panel,
                                vectors);
            }
    }
}

/* ``zero``: int8 weights' zero point per row [N], or NULL (symmetric; fp8 takes none). */
void w8_to_blocked(const uint8_t *weight, int fp8, const float *scale, const int8_t *zero, int64_t scale_cols,
                   int64_t bn, int64_t bk, int64_t n0, int64_t n1, int64_t K, int bf16, int64_t block_rows,
                   int64_t padded_units, uint32_t *blocked, int num_threads) {
    const quantized_rows q = {weight, scale, NULL, zero, scale_cols, bn, bk, 0, fp8};
    to_blocked(&q, n0, n1, K, bf16, block_rows, padded_units, blocked, num_threads);
}

void w4_to_blocked(const uint8_t *packed, const float *scales, const float *zeros, int64_t group, int64_t n0,
                   int64_t n1, int64_t K, int bf16, int64_t block_rows, int64_t padded_units, uint32_t *blocked,
                   int num_threads) {
    const quantized_rows q = {packed, scales, zeros, NULL, 0, 1, 1, group, 0};
    to_blocked(&q, n0, n1, K, bf16, block_rows, padded_units, blocked, num_threads);
}

/* Which panel dtypes this build dequantizes in vector tiles: bit 0 float32 (AVX2,
 * AVX-512), bit 1 bfloat16 (AVX-512). */
int panel_vector_tiles(void) { return VECTOR_TILES; }
