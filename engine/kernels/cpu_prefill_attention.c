/* Causal attention of prefill chunks for the CPU path: each chunk's query tokens
 * over its request's context, read straight out of the paged KV cache through the
 * block tables (the step's own keys and values are already there). float32, and
 * bfloat16 read into float32, accumulated there and rounded once on the way out;
 * where the target has AVX512_BF16 (DOT_BF16, cpu_common.h), bfloat16 queries and
 * keys are multiplied as they are by its dot-product instruction, the products summed
 * in float32.
 *
 * Work item = (request, KV head, tile of QT consecutive query tokens). The G query
 * heads of the KV head make G * QT query rows that share every key and value read.
 * Keys go through in blocks of KB = KN x VL (VL the target's vector width in floats:
 * 16 with AVX-512, 8 otherwise; KN = 1 and 2 there, below), each transposed once per
 * item into kt[D][KN] vectors (VL x VL at a time, by vector shuffles), so a query
 * row's KB scores are KN vectors built by D multiply-adds each; an online softmax per
 * row (running max m, running sum l,
 * accumulator acc rescaled when the max grows) then adds the block's values. Rows
 * go RB = 4 at a time, so each key and value vector loaded feeds four rows, and the
 * values are added COLS vectors of columns at a time with the four rows'
 * accumulators in registers (4 x 4 of AVX-512's 32 registers, 4 x 2 of AVX2's 16:
 * more would spill to the stack, which costs AVX2 ten times the time). Blocks
 * wholly in a row block's future (or before its sliding window) are skipped. Items
 * run in parallel (OpenMP, dynamic schedule), request by request, the costliest first.
 *
 * The vectors are GCC vector extensions, sized to the registers of the target the
 * library is built for (kernels/native.py): zmm with AVX-512, ymm with AVX2, pairs
 * of NEON registers on ARM.
 *
 * Layouts (asserted by the Python launcher, kernels/cpu_prefill_attention.py):
 *   q:               [T, H, D], D contiguous, strides q_stride_t, q_stride_h (elements)
 *   k_cache:         [num_blocks, block_size, Hkv, D] contiguous
 *   v_cache:         [num_blocks, block_size, Hkv, Dv] contiguous (Dv may differ from D)
 *   block_tables:    [B, table_stride] int32
 *   query_start_loc: [B + 1] int64: request b's query tokens are packed rows
 *                    query_start_loc[b] .. query_start_loc[b + 1] - 1, the last ones
 *                    of its context of seq_lens[b] tokens
 *   seq_lens:        [B] int64
 *   requests:        [n] int64: which of the B requests to attend
 *   out:             [T, H, Dv] contiguous; only the listed requests' rows are written
 *   sinks:           [H] float64 or NULL: a logit per head in each softmax's denominator
 *   alibi:           [H] float64 or NULL: slope_h * (key - query position) added to scores
 * D and Dv are multiples of 16 (so of VL), at most MAX_HEAD_DIM; window > 0 keeps the
 * last `window` positions; chunk > 0 keeps the positions of the query's aligned chunk
 * of `chunk`; softcap > 0 applies softcap * tanh(score / softcap) before the softmax
 * (after ALiBi). A sink starts a row's online softmax: running max = sink, sum = 1.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

/* Value vectors added at a time per row block (see above). */
#if VL == 16
#define COLS 4
#else
#define COLS 2
#endif
#define QT 16
/* Key vectors per block: two with AVX2, so a row block's scores are RB x 2 chains of
 * multiply-adds (enough to keep both FMA units busy through their latency) and each
 * query element broadcast feeds two; one with AVX-512, whose RB chains are doubled by
 * summing even and odd d apart instead (RB x 2 x 2 would not fit AVX2's registers). */
#if VL == 16
#define KN 1
#else
#define KN 2
#endif
#define KB (KN * VL)
#define RB 4
#define MAX_HEAD_DIM 256

/* Per-thread scratch, for rows = G * QT query rows rounded up to RB, of head sizes D, Dv. */
struct scratch {
    float *qs;   /* [rows][D] scaled queries */
    vf *acc;     /* [rows][Dv / VL] */
    float *m, *l;
    int64_t *pos; /* [rows] position of each row */
    vf *kt;      /* [D][KN] the block's keys, transposed */
};

/* The first key position a query at `position` sees (its window and its chunk). */
static inline int64_t first_key(int64_t position, int64_t window, int64_t chunk) {
    int64_t first = window > 0 && position >= window ? position - window + 1 : 0;
    if (chunk > 0 && position - position % chunk > first) first = position - position % chunk;
    return first;
}

/* Pair `index` of the bfloat16 pairs stored from `row` on, in every lane. */
static inline vf splat_pair(const float *row, int64_t index) {
    uint32_t pair;
    memcpy(&pair, (const char *)row + index * (int64_t)sizeof pair, sizeof pair);
    return (vf)((vu){0} + pair);
}

static inline __attribute__((always_inline)) void attend_tile(
    const void *q, int64_t q_stride_t, int64_t q_stride_h, const void *k_cache, const void *v_cache,
    const int32_t *table, int64_t block_size, int64_t row_stride, int64_t v_row_stride, void *out,
    int64_t num_heads, int64_t first_row, int64_t context, int64_t r0, int64_t r1, int64_t h, int64_t group,
    const int64_t D, const int64_t Dv, float scale, int64_t window, float softcap, const double *sinks,
    const double *alibi, int64_t chunk, const struct scratch *w, const int bf16)
{
    /* Query tokens r0 .. r1 - 1 of the chunk, at positions context + r0 .. context + r1 - 1. */
    const int64_t DV = Dv / VL;  /* value vectors per row */
    const int64_t rows = (r1 - r0) * group;
    /* Bfloat16 keys by the dot-product instruction (DOT_BF16, cpu_common.h): kt holds
     * D / 2 vectors of VL keys' (d, d + 1) pairs, the queries stay bfloat16 and the
     * scale multiplies the scores (as torch's bfloat16 attention scales its float32
     * product). */
    const int dot = DOT_BF16 && bf16 && KN == 1 && D % (2 * VL) == 0;
    const int64_t padded_rows = (rows + RB - 1) / RB * RB;  /* repeats of the last row */
    for (int64_t i = 0; i < padded_rows; i++) {
        const int64_t row = i < rows ? i : rows - 1;
        const int64_t qh = (first_row + r0 + row / group) * q_stride_t + (h * group + row % group) * q_stride_h;
        if (dot)  /* the query as it is: D / 2 pairs of bfloat16 at the row's start */
            memcpy(&w->qs[i * D], (const uint16_t *)q + qh, (size_t)D * sizeof(uint16_t));
        else
            for (int64_t d = 0; d < D; d++) w->qs[i * D + d] = load1(q, qh + d, bf16) * scale;
        for (int64_t d = 0; d < DV; d++) w->acc[i * DV + d] = splat(0.0f);
        w->m[i] = sinks ? (float)sinks[h * group + row % group] : -INFINITY;
        w->l[i] = sinks ? 1.0f : 0.0f;
        w->pos[i] = context + r0 + row / group;
    }
    const int64_t end = context + r1;  /* keys 0 .. end - 1 are the tile's */
    const int64_t lowest = first_key(w->pos[0], window, chunk);  /* first key seen */
    for (int64_t kb = lowest - lowest % KB; kb < end; kb += KB) {
        const int64_t num_keys = end - kb < KB ? end - kb : KB;
        /* Where each key's row starts in the caches, found once per block (keys past
         * the end repeat key kb; the mask drops them). */
        int64_t key_row[KB], value_row[KB];
        for (int64_t j = 0; j < KB; j++) {
            const int64_t position = kb + (j < num_keys ? j : 0);
            const int64_t slot = (int64_t)table[position / block_size] * block_size + position % block_size;
            key_row[j] = slot * row_stride + h * D;
            value_row[j] = slot * v_row_stride + h * Dv;
        }
        if (dot)
            for (int64_t d0 = 0; d0 < D; d0 += 2 * VL) {  /* VL keys by VL pairs of columns at a time */
                vf columns[VL];
                for (int j = 0; j < VL; j++)
                    memcpy(&columns[j], (const uint16_t *)k_cache + key_row[j] + d0, sizeof(vf));
                transpose(columns);
                for (int d = 0; d < VL; d++) w->kt[d0 / 2 + d] = columns[d];
            }
        else
        for (int n = 0; n < KN; n++)
            for (int64_t d0 = 0; d0 < D; d0 += VL) {  /* VL keys by VL columns at a time */
                vf columns[VL];
                for (int j = 0; j < VL; j++) columns[j] = loadv(k_cache, key_row[n * VL + j] + d0, bf16);
                transpose(columns);
                for (int d = 0; d < VL; d++) w->kt[(d0 + d) * KN + n] = columns[d];
            }
        for (int64_t i0 = 0; i0 < padded_rows; i0 += RB) {
            const int64_t last_pos = w->pos[i0 + RB - 1], first_pos = w->pos[i0];
            if (kb > last_pos || kb + KB <= first_key(first_pos, window, chunk))
                continue;  /* every row of the block sees none of these keys */
            vf s[RB][KN];
#if KN == 1  /* even and odd d (pairs of d with DOT_BF16) in separate sums */
            vf odd[RB];
            for (int b = 0; b < RB; b++) s[b][0] = odd[b] = splat(0.0f);
#if DOT_BF16
            if (dot) {
                for (int64_t d = 0; d < D / 2; d += 2) {
                    const vf kd = w->kt[d], kd1 = w->kt[d + 1];
                    for (int b = 0; b < RB; b++) {
                        s[b][0] = dot_bf16(s[b][0], splat_pair(&w->qs[(i0 + b) * D], d), kd);
                        odd[b] = dot_bf16(odd[b], splat_pair(&w->qs[(i0 + b) * D], d + 1), kd1);
                    }
                }
                for (int b = 0; b < RB; b++) s[b][0] = (s[b][0] + odd[b]) * scale;
            } else
#endif
            {
            for (int64_t d = 0; d < D; d += 2) {
                const vf kd = w->kt[d], kd1 = w->kt[d + 1];
                for (int b = 0; b < RB; b++) {
                    s[b][0] += w->qs[(i0 + b) * D + d] * kd;
                    odd[b] += w->qs[(i0 + b) * D + d + 1] * kd1;
                }
            }
            for (int b = 0; b < RB; b++) s[b][0] += odd[b];
            }
#else
            for (int b = 0; b < RB; b++)
                for (int n = 0; n < KN; n++) s[b][n] = splat(0.0f);
            for (int64_t d = 0; d < D; d++) {
                vf kd[KN];
                for (int n = 0; n < KN; n++) kd[n] = w->kt[d * KN + n];
                for (int b = 0; b < RB; b++) {
                    const float qd = w->qs[(i0 + b) * D + d];
                    for (int n = 0; n < KN; n++) s[b][n] += qd * kd[n];
                }
            }
#endif
            /* The block's probabilities, kept in memory: the value loop broadcasts each
             * one from there (a load) rather than from a register lane (a shuffle). */
            float p[RB][KB] __attribute__((aligned(64)));
            for (int b = 0; b < RB; b++) {
                const int64_t i = i0 + b;
                vf scores[KN], largest = splat(-INFINITY);
                for (int n = 0; n < KN; n++) {
                    const vf keys = (vf)LANE_INDICES + (float)(kb + n * VL);
                    /* Keys in the row's future (which covers those past r1) or before its window or chunk. */
                    vi masked = keys > (float)w->pos[i];
                    if (window > 0 || chunk > 0) masked |= keys < (float)first_key(w->pos[i], window, chunk);
                    if (alibi)  /* the row's query head: h * group + its head in the group */
                        s[b][n] += (float)alibi[h * group + (i < rows ? i : rows - 1) % group]
                                   * (keys - (float)w->pos[i]);
                    const vf capped = softcap > 0 ? softcap * vtanh(s[b][n] * (1.0f / softcap)) : s[b][n];
                    scores[n] = blend(masked, splat(-INFINITY), capped);
                    largest = vmax(largest, scores[n]);
                }
                const float block_max = hmax(largest);
                const float new_max = block_max > w->m[i] ? block_max : w->m[i];
                if (new_max == -INFINITY) {  /* no key seen yet: all before its window */
                    for (int j = 0; j < KB; j++) p[b][j] = 0.0f;
                    continue;
                }
                const float correction = exp_f32(w->m[i] - new_max);
                vf total = splat(0.0f);
                for (int n = 0; n < KN; n++) {
                    const vf probabilities = vexp(scores[n] - new_max);
                    memcpy(&p[b][n * VL], &probabilities, sizeof probabilities);
                    total += probabilities;
                }
                w->l[i] = w->l[i] * correction + hsum(total);
                w->m[i] = new_max;
                if (correction != 1.0f)
                    for (int64_t d = 0; d < DV; d++) w->acc[i * DV + d] *= correction;
            }
            const int64_t num_used = last_pos - kb + 1 < num_keys ? last_pos - kb + 1 : num_keys;
            if (DV % COLS == 0) {  /* COLS vectors of columns at a time, accumulators in registers */
                for (int64_t c = 0; c < DV; c += COLS) {
                    vf a[RB][COLS];
                    for (int b = 0; b < RB; b++)
                        for (int d = 0; d < COLS; d++) a[b][d] = w->acc[(i0 + b) * DV + c + d];
                    for (int64_t j = 0; j < num_used; j++) {
                        const int64_t vr = value_row[j] + VL * c;
                        vf v[COLS];
                        for (int d = 0; d < COLS; d++) v[d] = loadv(v_cache, vr + VL * d, bf16);
                        for (int b = 0; b < RB; b++) {
                            const float pj = p[b][j];
                            for (int d = 0; d < COLS; d++) a[b][d] += pj * v[d];
                        }
                    }
                    for (int b = 0; b < RB; b++)
                        for (int d = 0; d < COLS; d++) w->acc[(i0 + b) * DV + c + d] = a[b][d];
                }
            } else {
                for (int64_t j = 0; j < num_used; j++) {
                    const int64_t vr = value_row[j];
                    for (int64_t d = 0; d < DV; d++) {
                        const vf vd = loadv(v_cache, vr + VL * d, bf16);
                        for (int b = 0; b < RB; b++) w->acc[(i0 + b) * DV + d] += p[b][j] * vd;
                    }
                }
            }
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        const int64_t o = ((first_row + r0 + i / group) * num_heads + h * group + i % group) * Dv;
        const float inverse = 1.0f / w->l[i];
        for (int64_t d = 0; d < DV; d++) storev(out, o + VL * d, w->acc[i * DV + d] * inverse, bf16);
    }
}

/* A work item: query tile `index` of request `request` for KV head `head`. */
struct tile { int64_t request, index, head; };
/* A request and the keys its tiles attend in all, by which the requests are ordered. */
struct request_cost { int64_t request, cost; };

static int costlier_first(const void *a, const void *b) {
    const int64_t x = ((const struct request_cost *)a)->cost, y = ((const struct request_cost *)b)->cost;
    return (x < y) - (x > y);
}

/* Returns 0, or -1 when scratch memory could not be allocated (nothing written then). */
static inline __attribute__((always_inline)) int prefill_attention(
    const void *q, int64_t q_stride_t, int64_t q_stride_h, const void *k_cache, const void *v_cache,
    const int32_t *block_tables, int64_t table_stride, const int64_t *query_start_loc, const int64_t *seq_lens,
    const int64_t *requests, int64_t num_requests, void *out, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t head_dim_v, int64_t block_size, double scale, int64_t window, double softcap,
    const double *sinks, const double *alibi, int64_t chunk, int num_threads, const int bf16)
{
    const int64_t group = num_heads / num_kv_heads, row_stride = num_kv_heads * head_dim;
    const int64_t v_row_stride = num_kv_heads * head_dim_v;
    /* Items run request by request, the costliest requests first (dynamic scheduling
     * then ends on small items), and within a request KV head by head, tiles in order:
     * each tile reads its predecessor's keys and values again, which are then still in
     * this core's caches (a head's context, a few hundred KB, fits its L2). */
    int64_t num_tiles = 0;
    for (int64_t n = 0; n < num_requests; n++) {
        const int64_t b = requests[n];
        num_tiles += (query_start_loc[b + 1] - query_start_loc[b] + QT - 1) / QT;
    }
    struct tile *tiles = malloc((size_t)(num_tiles * num_kv_heads + 1) * sizeof(struct tile));
    struct request_cost *order = malloc((size_t)(num_requests + 1) * sizeof(struct request_cost));
    if (tiles == NULL || order == NULL) {
        free(tiles);
        free(order);
        return -1;
    }
    for (int64_t n = 0; n < num_requests; n++) {
        const int64_t b = requests[n], length = query_start_loc[b + 1] - query_start_loc[b];
        order[n] = (struct request_cost){b, 0};
        for (int64_t t = 0; t * QT < length; t++) {
            const int64_t keys = seq_lens[b] - length + (t * QT + QT < length ? t * QT + QT : length);
            int64_t cost = window > 0 && keys > window ? window : keys;
            if (chunk > 0 && cost > chunk) cost = chunk;
            order[n].cost += cost;
        }
    }
    qsort(order, (size_t)num_requests, sizeof(struct request_cost), costlier_first);
    int64_t count = 0;
    for (int64_t n = 0; n < num_requests; n++) {
        const int64_t b = order[n].request, length = query_start_loc[b + 1] - query_start_loc[b];
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int64_t t = 0; t * QT < length; t++) tiles[count++] = (struct tile){b, t, h};
    }
    free(order);
    const int64_t rows = (group * QT + RB - 1) / RB * RB;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        struct scratch w;
        w.qs = aligned_alloc(64, (size_t)(rows * head_dim) * sizeof(float));
        w.acc = aligned_alloc(64, (size_t)(rows * head_dim_v) * sizeof(float));
        w.kt = aligned_alloc(64, (size_t)(head_dim * KN) * sizeof(vf));
        w.m = malloc((size_t)rows * sizeof(float));
        w.l = malloc((size_t)rows * sizeof(float));
        w.pos = malloc((size_t)rows * sizeof(int64_t));
        if (!(w.qs && w.acc && w.kt && w.m && w.l && w.pos)) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp barrier")
        if (!failed) {
            _Pragma("omp for schedule(dynamic, 1)")
            for (int64_t item = 0; item < count; item++) {
                const struct tile *tile = &tiles[item];
                const int64_t b = tile->request, h = tile->head;
                const int64_t first_row = query_start_loc[b], length = query_start_loc[b + 1] - first_row;
                const int64_t context = seq_lens[b] - length;
                const int64_t r0 = tile->index * QT, r1 = r0 + QT < length ? r0 + QT : length;
                const int32_t *table = block_tables + b * table_stride;
                /* A constant head size unrolls the inner loops. */
                const int64_t size = head_dim == head_dim_v && (head_dim == 64 || head_dim == 128) ? head_dim : 0;
                if (size == 64)
                    attend_tile(q, q_stride_t, q_stride_h, k_cache, v_cache, table, block_size, row_stride,
                                v_row_stride, out, num_heads, first_row, context, r0, r1, h, group, 64, 64,
                                (float)scale, window, (float)softcap, sinks, alibi, chunk, &w, bf16);
                else if (size == 128)
                    attend_tile(q, q_stride_t, q_stride_h, k_cache, v_cache, table, block_size, row_stride,
                                v_row_stride, out, num_heads, first_row, context, r0, r1, h, group, 128, 128,
                                (float)scale, window, (float)softcap, sinks, alibi, chunk, &w, bf16);
                else
                    attend_tile(q, q_stride_t, q_stride_h, k_cache, v_cache, table, block_size, row_stride,
                                v_row_stride, out, num_heads, first_row, context, r0, r1, h, group, head_dim,
                                head_dim_v, (float)scale, window, (float)softcap, sinks, alibi, chunk, &w, bf16);
            }
        }
        free(w.qs);
        free(w.acc);
        free(w.kt);
        free(w.m);
        free(w.l);
        free(w.pos);
    }
    free(tiles);
    return failed ? -1 : 0;
}

/* The exported entry points, one per element type T (bf16: bfloat16 stored as its bits). */
#define DEFINE_ENTRY(NAME, T, BF16)                                                               \
int NAME(const T *q, int64_t q_stride_t, int64_t q_stride_h, const T *k_cache, const T *v_cache,  \
         const int32_t *block_tables, int64_t table_stride, const int64_t *query_start_loc,       \
         const int64_t *seq_lens, const int64_t *requests, int64_t num_requests, T *out,          \
         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t head_dim_v,            \
         int64_t block_size, double scale, int64_t window, double softcap, const double *sinks,   \
         const double *alibi, int64_t chunk, int num_threads)                                     \
{                                                                                                 \
    return prefill_attention(q, q_stride_t, q_stride_h, k_cache, v_cache, block_tables,          \
                             table_stride, query_start_loc, seq_lens, requests, num_requests,    \
                             out, num_heads, num_kv_heads, head_dim, head_dim_v, block_size,     \
                             scale, window, softcap, sinks, alibi, chunk, num_threads, BF16);    \
}

DEFINE_ENTRY(prefill_attention_f32, float, 0)
DEFINE_ENTRY(prefill_attention_bf16, uint16_t, 1)

int64_t prefill_attention_max_head_dim(void) { return MAX_HEAD_DIM; }
