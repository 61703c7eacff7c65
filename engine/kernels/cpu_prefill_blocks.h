/* The per-block steps of the CPU prefill attention (cpu_prefill_attention.c, whose
 * header comment describes the layout of rows, keys and values): a key block's cache
 * slots, its keys and values brought into the item's buffers, the rows' scores
 * (Q.K^T), the online-softmax step and the output's update (P.V).
 *
 * bfloat16 on builds and hosts with AMX-BF16 (PREFILL_AMX, the call's `amx`): both
 * products run as tile multiplies in the transposed orientation the rows already
 * have, so the softmax and the output stay as they are:
 *   S^T = K . Q^T: A the block's keys as stored (16 keys x 32 head elements a tile),
 *          B the row vector's queries (qt: pairs of head elements x 16 rows), C 16
 *          keys' scores for the 16 rows, each C row one vector s[j];
 *   out^T += V^T . P^T: A the block's values transposed (16 columns x 32 keys, built
 *          once per item and block), B the probabilities (p: pairs of keys x 16 rows,
 *          bfloat16 as the dot-product path rounds them), C 16 output columns of the
 *          16 rows (acc), loaded, multiplied into and stored back (a rescale by the
 *          softmax's correction runs on acc first, in vectors).
 * Products of bfloat16 values are exact and summed in float32, as the dot-product
 * instruction sums them; only the order of the sums differs. Head sizes that are
 * not whole runs of 32 elements take the dot-product path. */
#ifndef SHARDLINE_CPU_PREFILL_BLOCKS_H
#define SHARDLINE_CPU_PREFILL_BLOCKS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_common.h"
#if defined(__AVX__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

#define KB (2 * VL)     /* keys per block, their scores VL accumulators at a time */
#define CB VL           /* output columns in registers at a time in P.V */
#define TILE_ROWS 128   /* query rows (tokens x heads of a KV head) an item aims at */
#define MAX_HEAD_DIM 256
/* Tile multiplies for bfloat16 (above): AMX-BF16 with 16-lane vectors, one a tile row. */
#define PREFILL_AMX (HAVE_AMX_BF16 && DOT_BF16 && VL == 16)

/* What every item of a call shares. */
struct call {
    const void *q, *k_cache, *v_cache;
    void *out;
    int64_t q_stride_t, q_stride_h, block_size, row_stride, v_row_stride, num_heads, group, window, chunk;
    float scale, softcap;
    const double *sinks, *alibi;
    const int64_t *key_limits;  /* [T] the last key each packed query row sees, or NULL: its own */
    int amx;  /* bfloat16 products as tile multiplies (PREFILL_AMX; the tiles granted, D a multiple of 32) */
};

/* Per-thread scratch, sized for the largest tile of a call. */
struct scratch {
    vf *qt;       /* [vectors][D] the rows' queries, transposed (pairs of bf16 with dot) */
    vf *acc;      /* [vectors][Dv] the rows' outputs, transposed */
    vf *m, *l;    /* [vectors] running max and sum */
    vf *first, *last, *pos, *slope;  /* [vectors] visible keys, position, ALiBi slope */
    int64_t *span; /* [vectors][4] lowest and highest first, lowest and highest last */
    vf *p;        /* [KB] the block's probabilities (pairs of bf16 with dot) */
    float *keys;  /* [KB][D] the block's keys (bf16 as stored with dot) */
    float *values; /* [KB][Dv] the block's values (widened from bf16 without dot); key pairs with dot;
                    * with amx [Dv][KB] bf16, transposed */
};

/* The first key position a query at `position` sees (its window and its chunk). */
static inline int64_t first_key(int64_t position, int64_t window, int64_t chunk) {
    int64_t first = window > 0 && position >= window ? position - window + 1 : 0;
    if (chunk > 0 && position - position % chunk > first) first = position - position % chunk;
    return first;
}

/* `bits` (32-bit) in every lane. */
static inline vf splat_bits(const void *bits) {
    uint32_t word;
    memcpy(&word, bits, sizeof word);
    return (vf)((vu){0} + word);
}

/* The cache slots of keys kb .. kb + num_keys - 1 (kb a multiple of KB); slots from
 * num_keys on repeat key kb's. Where the cache's blocks hold whole multiples of VL
 * keys, each VL keys are consecutive slots of one block (no division per key). */
static inline void block_slots(const struct call *c, const int32_t *table, int64_t kb, int64_t num_keys,
                               int64_t slots[KB])
{
    const int64_t bs = c->block_size;
    for (int j0 = 0; j0 < KB; j0 += VL) {
        const int64_t first = kb + j0;  /* a table entry read only for positions in the context */
        const int64_t base = j0 < num_keys ? (int64_t)table[first / bs] * bs + first % bs : 0;
        for (int j = j0; j < j0 + VL; j++) {
            const int64_t position = kb + (j < num_keys ? j : 0);
            slots[j] = j >= num_keys ? slots[0]
                : bs % VL == 0 ? base + j - j0 : (int64_t)table[position / bs] * bs + position % bs;
        }
    }
}

/* The block's keys and values into the contiguous buffers (widened from bfloat16
 * without dot; with dot the keys as stored, the values interleaved by key pairs), so
 * the products read a key's or value's element at a fixed offset from one pointer.
 * Keys from `num_keys` on repeat key kb (their probabilities are 0). */
static inline __attribute__((always_inline)) void load_block(
    const struct call *c, const struct scratch *w, const int32_t *table, int64_t kb, int64_t num_keys, int64_t h,
    const int64_t D, const int64_t Dv, const int bf16)
{
    const int dot = DOT_BF16 && bf16;  /* products by the dot-product instruction */
    int64_t slots[KB], key_row[KB], value_row[KB];
    block_slots(c, table, kb, num_keys, slots);
    for (int j = 0; j < KB; j++) {
        key_row[j] = slots[j] * c->row_stride + h * D;
        value_row[j] = slots[j] * c->v_row_stride + h * Dv;
    }
    if (dot) {
        for (int j = 0; j < KB; j++)
            memcpy((uint16_t *)w->keys + j * D, (const uint16_t *)c->k_cache + key_row[j], (size_t)D * 2);
#if PREFILL_AMX
        if (c->amx) {  /* row d of V^T: value d of keys 0 .. KB - 1, a 32-bit pair of keys a lane */
            for (int64_t d = 0; d < Dv; d += VL) {
                vf pairs[VL];  /* pairs[j / 2] lane i: value d + i of keys j and j + 1 */
                for (int j = 0; j < KB; j += 2)
                    pairs[j / 2] = (vf)(((vu)loadv(c->v_cache, value_row[j] + d, 1) >> 16)
                                        | (vu)loadv(c->v_cache, value_row[j + 1] + d, 1));
                transpose(pairs);
                for (int i = 0; i < VL; i++) memcpy(&w->values[(d + i) * (KB / 2)], &pairs[i], sizeof(vf));
            }
            return;
        }
#endif
        for (int j = 0; j < KB; j += 2)  /* lane d of pair j / 2: value d of keys j and j + 1 */
            for (int64_t d = 0; d < Dv; d += VL) {
                const vu low = (vu)loadv(c->v_cache, value_row[j] + d, 1) >> 16;
                const vu high = (vu)loadv(c->v_cache, value_row[j + 1] + d, 1);
                const vu pair = low | high;
                memcpy(&w->values[j / 2 * Dv + d], &pair, sizeof pair);
            }
        return;
    }
    for (int j = 0; j < KB; j++) {
        for (int64_t d = 0; d < D; d += VL) {
            const vf k = loadv(c->k_cache, key_row[j] + d, bf16);
            memcpy(&w->keys[j * D + d], &k, sizeof k);
        }
        for (int64_t d = 0; d < Dv; d += VL) {
            const vf v = loadv(c->v_cache, value_row[j] + d, bf16);
            memcpy(&w->values[j * Dv + d], &v, sizeof v);
        }
    }
}

/* Asks for the cache lines of the next block's keys and values (positions kb ..
 * kb + num_keys - 1) while this block's products run. */
static inline __attribute__((always_inline)) void prefetch_block(
    const struct call *c, const int32_t *table, int64_t kb, int64_t num_keys, int64_t h, const int64_t D,
    const int64_t Dv, const int bf16)
{
    const int64_t element = bf16 ? 2 : 4;
    int64_t slots[KB];
    block_slots(c, table, kb, num_keys, slots);
    for (int64_t j = 0; j < num_keys; j++) {
        const char *key = (const char *)c->k_cache + (slots[j] * c->row_stride + h * D) * element;
        const char *value = (const char *)c->v_cache + (slots[j] * c->v_row_stride + h * Dv) * element;
        for (int64_t b = 0; b < D * element; b += 64) __builtin_prefetch(key + b);
        for (int64_t b = 0; b < Dv * element; b += 64) __builtin_prefetch(value + b);
    }
}

#if PREFILL_AMX
/* Every tile 16 rows of 64 bytes: 0, 4 the scores of the block's two halves (C); 1, 3
 * their keys (A); 2 the queries (B); 5 the output's columns (C); 6 the values (A); 7
 * the probabilities (B). Loaded by each thread before its items. */
static inline void prefill_tiles_configure(void) {
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    const uint16_t bytes[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_load_config(8, rows, bytes);
}

/* block_scores through the tiles: s[j] the rows' scores for key kb + j (keys from
 * `used` on -inf where a whole VL of them is past the rows' last key). */
static inline __attribute__((always_inline)) void block_scores_amx(
    const struct call *c, const struct scratch *w, int64_t r, vf s[KB], int64_t used, const int64_t D)
{
    float sums[KB][VL] __attribute__((aligned(64)));
    const uint16_t *keys = (const uint16_t *)w->keys;  /* [KB][D] as stored */
    const vf *qt = &w->qt[r * D];  /* pairs of head elements: D / 2 vectors of the rows */
    const int second = used > VL;  /* the block's second VL keys are seen */
    _tile_zero(0);
    _tile_zero(4);
    for (int64_t d = 0; d < D; d += 32) {
        _tile_loadd(2, qt + d / 2, 64);
        _tile_loadd(1, keys + d, D * 2);
        _tile_dpbf16ps(0, 1, 2);
        if (second) {
            _tile_loadd(3, keys + VL * D + d, D * 2);
            _tile_dpbf16ps(4, 3, 2);
        }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(4, sums[VL], 64);
    for (int j = 0; j < KB; j++) {
        vf sum;
        memcpy(&sum, sums[j], sizeof sum);
        s[j] = j < VL || second ? sum * c->scale : splat(-INFINITY);
    }
}

/* block_values through the tiles: out^T += V^T . P^T over the block's keys (their
 * probabilities 0 from `used` on), the output rescaled first. */
static inline __attribute__((always_inline)) void block_values_amx(
    const struct scratch *w, int64_t r, vf correction, int64_t used, const int64_t Dv)
{
    vf *acc = &w->acc[r * Dv];
    int rescale = 0;  /* once the rows' maxima settle, most blocks leave them (factor 1) */
    for (int lane = 0; lane < VL; lane++) rescale |= correction[lane] != 1.0f;
    if (rescale)
        for (int64_t col = 0; col < Dv; col++) acc[col] *= correction;
    for (int64_t j = (used + 1) / 2; j < KB / 2; j++) w->p[j] = splat(0.0f);  /* keys no row sees */
    _tile_loadd(7, w->p, 64);
    const uint16_t *values = (const uint16_t *)w->values;  /* [Dv][KB] */
    for (int64_t col = 0; col < Dv; col += VL) {
        _tile_loadd(5, acc + col, 64);
        _tile_loadd(6, values + col * KB, KB * 2);
        _tile_dpbf16ps(5, 6, 7);
        _tile_stored(5, acc + col, 64);
    }
}
#endif

/* s[j]: the rows' scores for key kb + j, VL keys (VL accumulators) at a time; keys
 * from `used` on are -inf where a whole VL of them is past the rows' last key. */
static inline __attribute__((always_inline)) void block_scores(
    const struct call *c, const struct scratch *w, int64_t r, vf s[KB], int64_t used, const int64_t D,
    const int bf16)
{
    const int dot = DOT_BF16 && bf16;  /* products by the dot-product instruction */
    const vf *qt = &w->qt[r * D];
    for (int j0 = 0; j0 < KB; j0 += VL) {
        vf a[VL];
        for (int j = 0; j < VL; j++) a[j] = splat(j0 < used ? 0.0f : -INFINITY);
        if (j0 < used) {
#if DOT_BF16
            if (dot) {
                const uint32_t *keys = (const uint32_t *)w->keys + j0 * D / 2;  /* pairs: key j's at j * D / 2 */
                for (int64_t d = 0; d < D / 2; d++) {
                    const vf qd = qt[d];
                    for (int j = 0; j < VL; j++) a[j] = dot_bf16(a[j], qd, splat_bits(&keys[j * D / 2 + d]));
                }
                for (int j = 0; j < VL; j++) a[j] *= c->scale;
            } else
#endif
            {
                const float *keys = w->keys + j0 * D;
                for (int64_t d = 0; d < D; d++) {
                    const vf qd = qt[d];
                    for (int j = 0; j < VL; j++) a[j] += qd * keys[j * D + d];
                }
            }
        }
        for (int j = 0; j < VL; j++) s[j0 + j] = a[j];
    }
}

/* exp on the scores' lanes (at most 0 after the shift by the max; -inf for masked
 * keys). With AVX-512: x = n ln2 + r as exp_f32 does, e^r by the same series, times
 * 2^n by the scaling instruction; below -87 about 1e-38 (no subnormals), which the
 * softmax cannot tell from 0. Elsewhere vexp (cpu_common.h). */
#if VL == 16
static inline vf exp_scores(vf x) {
    x = (vf)_mm512_max_ps((__m512)x, _mm512_set1_ps(-87.0f));
    const vf n = (vf)_mm512_roundscale_ps((__m512)(x * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT);
    return (vf)_mm512_scalef_ps((__m512)EXP_F32_SERIES(EXP_F32_REMAINDER(x, n)), (__m512)n);
}
#else
static inline vf exp_scores(vf x) { return vexp(x); }
#endif

/* The larger of a and b lane by lane, b where either is NaN: vmax (cpu_common.h) as
 * the max instruction, which computes exactly that (GCC keeps vmax a compare and a
 * blend, two dependent steps). */
#if VL == 16
static inline vf max_lanes(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
#elif defined(__AVX__)
static inline vf max_lanes(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
#endif

/* The block's online-softmax step for row vector r: scores s (masked unless `whole`)
 * become probabilities in w->p; returns the factor the output must be rescaled by. */
static inline __attribute__((always_inline)) vf block_softmax(
    const struct call *c, const struct scratch *w, int64_t r, vf s[KB], int64_t kb, int whole, const int bf16)
{
    const int dot = DOT_BF16 && bf16;  /* products by the dot-product instruction */
    if (c->alibi || c->softcap > 0 || !whole)
        for (int j = 0; j < KB; j++) {
            const float key = (float)(kb + j);
            if (c->alibi) s[j] += w->slope[r] * (key - w->pos[r]);
            if (c->softcap > 0) s[j] = c->softcap * vtanh(s[j] * (1.0f / c->softcap));
            if (!whole) s[j] = blend((key > w->last[r]) | (key < w->first[r]), splat(-INFINITY), s[j]);
        }
#if VL == 16 || defined(__AVX__)
    /* The maximum as a tree of pairs (depth log2(KB) instead of a chain of KB steps). */
    vf pairs[KB / 2];
    for (int j = 0; j < KB / 2; j++) pairs[j] = max_lanes(s[2 * j], s[2 * j + 1]);
    for (int width = KB / 4; width >= 1; width /= 2)
        for (int j = 0; j < width; j++) pairs[j] = max_lanes(pairs[j], pairs[j + width]);
    const vf largest = max_lanes(w->m[r], pairs[0]);
#else  /* vectors emulated by pairs of SSE registers: the tree's temporaries spill */
    vf largest = w->m[r];
    for (int j = 0; j < KB; j++) largest = vmax(largest, s[j]);
#endif
    /* Lanes that have seen no key yet (all before their window) keep max -inf: their
     * probabilities are exp(-inf) ~ 0 against a max of 0. */
    const vf shift = blend(largest == -INFINITY, splat(0.0f), largest);
    const vf correction = exp_scores(w->m[r] - shift);
    vf total = splat(0.0f);
    for (int j = 0; j < KB; j++) {
        s[j] = exp_scores(s[j] - shift);
        total += s[j];
    }
    w->l[r] = w->l[r] * correction + total;
    w->m[r] = largest;
    if (dot)  /* lane i of pair j / 2: keys j and j + 1's probabilities, bfloat16 */
        for (int j = 0; j < KB; j += 2)
            w->p[j / 2] = (vf)((bf16_bits_v(s[j]) >> 16) | bf16_bits_v(s[j + 1]));
    else
        for (int j = 0; j < KB; j++) w->p[j] = s[j];
    return correction;
}

/* out^T += P.V for row vector r over the block's first `used` keys, rescaled first. */
static inline __attribute__((always_inline)) void block_values(
    const struct scratch *w, int64_t r, vf correction, int64_t used, const int64_t Dv, const int bf16)
{
    const int dot = DOT_BF16 && bf16;  /* products by the dot-product instruction */
    vf *acc = &w->acc[r * Dv];
    int rescale = 0;  /* once the rows' maxima settle, most blocks leave them (factor 1) */
    for (int lane = 0; lane < VL; lane++) rescale |= correction[lane] != 1.0f;
    for (int64_t col = 0; col < Dv; col += CB) {
        vf a[CB];
        for (int i = 0; i < CB; i++) a[i] = rescale ? acc[col + i] * correction : acc[col + i];
#if DOT_BF16
        if (dot) {
            const uint32_t *pairs = (const uint32_t *)w->values;
            for (int64_t j = 0; j < (used + 1) / 2; j++) {
                const vf pj = w->p[j];
                for (int i = 0; i < CB; i++) a[i] = dot_bf16(a[i], pj, splat_bits(&pairs[j * Dv + col + i]));
            }
        } else
#endif
        {
            for (int64_t j = 0; j < used; j++) {
                const vf pj = w->p[j];
                const float *v = w->values + j * Dv + col;
                for (int i = 0; i < CB; i++) a[i] += pj * v[i];
            }
        }
        for (int i = 0; i < CB; i++) acc[col + i] = a[i];
    }
}

#endif
