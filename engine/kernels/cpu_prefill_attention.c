/* Causal attention of prefill chunks for the CPU path: each chunk's query tokens
 * over its request's context, read straight out of the paged KV cache through the
 * block tables (the step's own keys and values are already there). float32, and
 * bfloat16 accumulated in float32 and rounded once on the way out.
 *
 * Work item = (request, KV head, tile of consecutive query tokens). The G query heads
 * of the KV head make the tile's rows (token-major, head-minor), held VL rows to a
 * vector (VL = 16 floats with AVX-512, 8 otherwise): every quantity a row has (its
 * scores for one key, running max, running sum, output column) is one lane, so the
 * online softmax needs no horizontal reduction and every multiply-add is a vector of
 * VL rows times one broadcast element of a key or value row (an outer product).
 * Keys go KB = 2 VL at a time (the per-block steps: cpu_prefill_blocks.h):
 *   Q.K^T: VL accumulators at a time, one per key, each built by D multiply-adds of
 *          the rows' queries (kept transposed, q^T[d] a vector of rows) by key
 *          element d;
 *   softmax: per row lane, max over the block, rescale of the running sum and
 *          output, probabilities p = exp(s - max), all vertical;
 *   P.V:   the output, transposed too (out^T[c] a vector of rows), CB columns at a
 *          time in registers, each key adding p_key (a vector of rows) times value
 *          element c.
 * The block's keys and values are copied once per item into contiguous buffers (so a
 * key's or value's element is a fixed offset) and serve every row vector of the tile; the next block's
 * key and value rows are prefetched meanwhile. Key blocks past a row vector's last
 * visible key, or before its first (window, chunk), are skipped whole (and the second
 * VL keys of a block its last key does not reach); blocks it sees whole skip the
 * masks. Items run in parallel (OpenMP, dynamic schedule), request by request, the
 * costliest first.
 *
 * bfloat16: where the target has AVX512_BF16 (DOT_BF16, cpu_common.h) both products
 * run on its dot-product instruction, float32 sums: Q.K^T on pairs of head elements
 * (queries and keys as stored), P.V on pairs of keys (the probabilities rounded to
 * bfloat16 as torch's bfloat16 attention rounds them before its P.V matmul; the
 * block's values interleaved by key pairs once per item). Where the target and host
 * have AMX-BF16 too, both products run as tile multiplies instead
 * (cpu_prefill_blocks.h). Without AVX512_BF16, keys and values are widened to float32
 * once per block and item and take the float32 path.
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
 *   key_limits:      [T] int64 or NULL: the last key position each packed query row sees
 *                    (NULL: its own; later for the rows of an image attending both ways)
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
#include "cpu_prefill_blocks.h"

/* The tile's rows: transposed queries, positions, visible spans and softmax starts. */
static inline __attribute__((always_inline)) void load_rows(
    const struct call *c, const struct scratch *w, int64_t first_row, int64_t context, int64_t r0,
    int64_t rows, int64_t h, const int64_t D, const int64_t Dv, const int bf16)
{
    const int dot = DOT_BF16 && bf16;  /* products by the dot-product instruction */
    const int64_t vectors = (rows + VL - 1) / VL;
    const int64_t lanes_per_row = dot ? D / 2 : D;  /* 32-bit lanes of a row's query in qt */
    for (int64_t i = 0; i < vectors * VL; i++) {
        const int64_t row = i < rows ? i : rows - 1;  /* lanes past the rows repeat the last */
        const int64_t r = i / VL, lane = i % VL, head = h * c->group + row % c->group;
        const int64_t position = context + r0 + row / c->group;
        const int64_t qh = (first_row + r0 + row / c->group) * c->q_stride_t + head * c->q_stride_h;
        if (lanes_per_row % VL == 0)
            ;  /* the queries go in VL rows at a time (below) */
        else if (dot)  /* pairs of bfloat16 as stored */
            for (int64_t d = 0; d < D / 2; d++)
                memcpy((uint32_t *)&w->qt[r * D + d] + lane, (const uint32_t *)((const uint16_t *)c->q + qh) + d, 4);
        else
            for (int64_t d = 0; d < D; d++) w->qt[r * D + d][lane] = load1(c->q, qh + d, bf16) * c->scale;
        w->pos[r][lane] = (float)position;
        w->last[r][lane] = (float)(c->key_limits ? c->key_limits[first_row + r0 + row / c->group] : position);
        w->first[r][lane] = (float)first_key(position, c->window, c->chunk);
        w->slope[r][lane] = c->alibi ? (float)c->alibi[head] : 0.0f;
        w->m[r][lane] = c->sinks ? (float)c->sinks[head] : -INFINITY;
        w->l[r][lane] = c->sinks ? 1.0f : 0.0f;
    }
    /* VL rows' queries at a time: VL elements of each row loaded, then transposed. */
    for (int64_t r = 0; r < vectors && lanes_per_row % VL == 0; r++) {
        int64_t qh[VL];  /* each lane's query row */
        for (int lane = 0; lane < VL; lane++) {
            const int64_t row = r * VL + lane < rows ? r * VL + lane : rows - 1;
            qh[lane] = (first_row + r0 + row / c->group) * c->q_stride_t
                + (h * c->group + row % c->group) * c->q_stride_h;
        }
        for (int64_t d = 0; d < lanes_per_row; d += VL) {
            vf x[VL];  /* x[lane]: that lane's row's elements d .. d + VL - 1 (pairs of bfloat16 as stored: dot) */
            for (int lane = 0; lane < VL; lane++) {
                if (dot)
                    memcpy(&x[lane], (const uint32_t *)((const uint16_t *)c->q + qh[lane]) + d, sizeof(vf));
                else
                    x[lane] = loadv(c->q, qh[lane] + d, bf16) * c->scale;
            }
            transpose(x);
            for (int i = 0; i < VL; i++) w->qt[r * D + d + i] = x[i];
        }
    }
    for (int64_t r = 0; r < vectors; r++) {
        int64_t *span = &w->span[4 * r];
        span[0] = span[2] = INT64_MAX;
        span[1] = span[3] = INT64_MIN;
        for (int lane = 0; lane < VL; lane++) {
            const int64_t first = (int64_t)w->first[r][lane], last = (int64_t)w->last[r][lane];
            span[0] = first < span[0] ? first : span[0];
            span[1] = first > span[1] ? first : span[1];
            span[2] = last < span[2] ? last : span[2];
            span[3] = last > span[3] ? last : span[3];
        }
        for (int64_t d = 0; d < Dv; d++) w->acc[r * Dv + d] = splat(0.0f);
    }
}

/* The tile's rows divided by their sums, transposed back into out's rows. */
static inline __attribute__((always_inline)) void store_rows(
    const struct call *c, const struct scratch *w, int64_t first_row, int64_t r0, int64_t rows, int64_t h,
    const int64_t Dv, const int bf16)
{
    for (int64_t r = 0; r * VL < rows; r++) {
        const vf inverse = 1.0f / w->l[r];
        for (int64_t col = 0; col < Dv; col += VL) {
            vf x[VL];
            for (int i = 0; i < VL; i++) x[i] = w->acc[r * Dv + col + i] * inverse;
            transpose(x);  /* x[lane]: row r * VL + lane's columns col .. col + VL - 1 */
            for (int lane = 0; lane < VL && r * VL + lane < rows; lane++) {
                const int64_t row = r * VL + lane;
                const int64_t o = ((first_row + r0 + row / c->group) * c->num_heads + h * c->group
                                   + row % c->group) * Dv;
                storev(c->out, o + col, x[lane], bf16);
            }
        }
    }
}

/* Query tokens r0 .. r1 - 1 of a chunk at packed row first_row, at positions
 * context + r0 .. context + r1 - 1, for KV head h. */
static inline __attribute__((always_inline)) void attend_tile(
    const struct call *c, const struct scratch *w, const int32_t *table, int64_t first_row, int64_t context,
    int64_t r0, int64_t r1, int64_t h, const int64_t D, const int64_t Dv, const int bf16)
{
    const int64_t rows = (r1 - r0) * c->group, vectors = (rows + VL - 1) / VL;
    load_rows(c, w, first_row, context, r0, rows, h, D, Dv, bf16);
    int64_t lowest = INT64_MAX, highest = INT64_MIN;
    for (int64_t r = 0; r < vectors; r++) {
        lowest = w->span[4 * r] < lowest ? w->span[4 * r] : lowest;
        highest = w->span[4 * r + 3] > highest ? w->span[4 * r + 3] : highest;
    }
    for (int64_t kb = lowest - lowest % KB; kb <= highest; kb += KB) {
        const int64_t num_keys = highest - kb + 1 < KB ? highest - kb + 1 : KB;
        load_block(c, w, table, kb, num_keys, h, D, Dv, bf16);
        if (kb + KB <= highest)
            prefetch_block(c, table, kb + KB, highest - kb - KB + 1 < KB ? highest - kb - KB + 1 : KB, h, D, Dv, bf16);
        for (int64_t r = 0; r < vectors; r++) {
            const int64_t *span = &w->span[4 * r];
            if (kb > span[3] || kb + KB <= span[0]) continue;  /* no row of the vector sees these keys */
            const int whole = kb >= span[1] && kb + KB - 1 <= span[2];
            const int64_t used = span[3] - kb + 1 < KB ? span[3] - kb + 1 : KB;  /* keys up to the last seen */
            vf s[KB];
#if PREFILL_AMX
            if (bf16 && c->amx) {
                block_scores_amx(c, w, r, s, used, D);
                block_values_amx(w, r, block_softmax(c, w, r, s, kb, whole, bf16), used, Dv);
                continue;
            }
#endif
            block_scores(c, w, r, s, used, D, bf16);
            const vf correction = block_softmax(c, w, r, s, kb, whole, bf16);
            block_values(w, r, correction, used, Dv, bf16);
        }
    }
    store_rows(c, w, first_row, r0, rows, h, Dv, bf16);
}

/* A work item: query tile `index` of request `request` for KV head `head`. */
struct tile { int64_t request, index, head; };
/* A request and the keys its tiles attend in all, by which the requests are ordered. */
struct request_cost { int64_t request, cost; };

static int costlier_first(const void *a, const void *b) {
    const int64_t x = ((const struct request_cost *)a)->cost, y = ((const struct request_cost *)b)->cost;
    return (x < y) - (x > y);
}

/* The call's items, request by request, the costliest requests first (dynamic
 * scheduling then ends on small items), and within a request KV head by head, tiles
 * in order: each tile reads its predecessor's keys and values again, which are then
 * still in this core's caches. NULL when out of memory. */
static struct tile *make_tiles(const int64_t *query_start_loc, const int64_t *seq_lens, const int64_t *requests,
                               int64_t num_requests, int64_t num_kv_heads, int64_t tokens, int64_t window,
                               int64_t chunk, int64_t *count)
{
    int64_t num_tiles = 0;
    for (int64_t n = 0; n < num_requests; n++) {
        const int64_t b = requests[n];
        num_tiles += (query_start_loc[b + 1] - query_start_loc[b] + tokens - 1) / tokens;
    }
    struct tile *tiles = malloc((size_t)(num_tiles * num_kv_heads + 1) * sizeof(struct tile));
    struct request_cost *order = malloc((size_t)(num_requests + 1) * sizeof(struct request_cost));
    if (tiles == NULL || order == NULL) {
        free(tiles);
        free(order);
        return NULL;
    }
    for (int64_t n = 0; n < num_requests; n++) {
        const int64_t b = requests[n], length = query_start_loc[b + 1] - query_start_loc[b];
        order[n] = (struct request_cost){b, 0};
        for (int64_t t = 0; t * tokens < length; t++) {
            const int64_t keys = seq_lens[b] - length + (t * tokens + tokens < length ? t * tokens + tokens : length);
            int64_t cost = window > 0 && keys > window ? window : keys;
            if (chunk > 0 && cost > chunk) cost = chunk;
            order[n].cost += cost;
        }
    }
    qsort(order, (size_t)num_requests, sizeof(struct request_cost), costlier_first);
    *count = 0;
    for (int64_t n = 0; n < num_requests; n++) {
        const int64_t b = order[n].request, length = query_start_loc[b + 1] - query_start_loc[b];
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int64_t t = 0; t * tokens < length; t++) tiles[(*count)++] = (struct tile){b, t, h};
    }
    free(order);
    return tiles;
}

/* Scratch for tiles of up to `rows` rows; 0 when every buffer was allocated. */
static int alloc_scratch(struct scratch *w, int64_t rows, int64_t D, int64_t Dv) {
    const int64_t vectors = (rows + VL - 1) / VL, widest = D > Dv ? D : Dv;
    memset(w, 0, sizeof *w);
    w->qt = aligned_alloc(64, (size_t)(vectors * D) * sizeof(vf));
    w->acc = aligned_alloc(64, (size_t)(vectors * Dv) * sizeof(vf));
    w->m = aligned_alloc(64, (size_t)(6 * vectors) * sizeof(vf));
    w->span = malloc((size_t)(4 * vectors) * sizeof(int64_t));
    w->p = aligned_alloc(64, (size_t)KB * sizeof(vf));
    w->keys = aligned_alloc(64, (size_t)(KB * widest) * sizeof(float));
    w->values = aligned_alloc(64, (size_t)(KB * widest) * sizeof(float));
    if (w->m) {
        w->l = w->m + vectors;
        w->first = w->m + 2 * vectors;
        w->last = w->m + 3 * vectors;
        w->pos = w->m + 4 * vectors;
        w->slope = w->m + 5 * vectors;
    }
    return !(w->qt && w->acc && w->m && w->span && w->p && w->keys && w->values);
}

static void free_scratch(struct scratch *w) {
    free(w->qt);
    free(w->acc);
    free(w->m);
    free(w->span);
    free(w->p);
    free(w->keys);
    free(w->values);
}

/* One item, its loops unrolled for the common head sizes. */
static inline __attribute__((always_inline)) void attend_item(
    const struct call *c, const struct scratch *w, const struct tile *tile, const int32_t *block_tables,
    int64_t table_stride, const int64_t *query_start_loc, const int64_t *seq_lens, int64_t tokens, int64_t D,
    int64_t Dv, const int bf16)
{
    const int64_t b = tile->request, h = tile->head;
    const int64_t first_row = query_start_loc[b], length = query_start_loc[b + 1] - first_row;
    const int64_t context = seq_lens[b] - length;
    const int64_t r0 = tile->index * tokens, r1 = r0 + tokens < length ? r0 + tokens : length;
    const int32_t *table = block_tables + b * table_stride;
    if (D == 64 && Dv == 64)
        attend_tile(c, w, table, first_row, context, r0, r1, h, 64, 64, bf16);
    else if (D == 128 && Dv == 128)
        attend_tile(c, w, table, first_row, context, r0, r1, h, 128, 128, bf16);
    else
        attend_tile(c, w, table, first_row, context, r0, r1, h, D, Dv, bf16);
}

/* Returns 0, or -1 when scratch memory could not be allocated (nothing written then). */
static inline __attribute__((always_inline)) int prefill_attention(
    const struct call *c, const int32_t *block_tables, int64_t table_stride, const int64_t *query_start_loc,
    const int64_t *seq_lens, const int64_t *requests, int64_t num_requests, int64_t num_kv_heads, int64_t D,
    int64_t Dv, int num_threads, const int bf16)
{
    const int64_t tokens = (TILE_ROWS + c->group - 1) / c->group;
    int64_t count = 0;
    struct tile *tiles = make_tiles(query_start_loc, seq_lens, requests, num_requests, num_kv_heads, tokens,
                                    c->window, c->chunk, &count);
    if (tiles == NULL) return -1;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        struct scratch w;
        if (alloc_scratch(&w, tokens * c->group, D, Dv)) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp barrier")
        if (!failed) {
#if PREFILL_AMX
            if (bf16 && c->amx) prefill_tiles_configure();
#endif
            _Pragma("omp for schedule(dynamic, 1)")
            for (int64_t item = 0; item < count; item++)
                attend_item(c, &w, &tiles[item], block_tables, table_stride, query_start_loc, seq_lens, tokens, D,
                            Dv, bf16);
#if PREFILL_AMX
            if (bf16 && c->amx) _tile_release();
#endif
        }
        free_scratch(&w);
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
         const double *alibi, int64_t chunk, int num_threads, const int64_t *key_limits)          \
{                                                                                                 \
    const struct call c = {                                                                       \
        .q = q, .k_cache = k_cache, .v_cache = v_cache, .out = out, .q_stride_t = q_stride_t,     \
        .q_stride_h = q_stride_h, .block_size = block_size, .row_stride = num_kv_heads * head_dim, \
        .v_row_stride = num_kv_heads * head_dim_v, .num_heads = num_heads,                        \
        .group = num_heads / num_kv_heads, .window = window, .chunk = chunk,                      \
        .scale = (float)scale, .softcap = (float)softcap, .sinks = sinks, .alibi = alibi,         \
        .key_limits = key_limits,                                                                 \
        .amx = PREFILL_AMX && (BF16) && head_dim % 32 == 0 && amx_ready()};                       \
    return prefill_attention(&c, block_tables, table_stride, query_start_loc, seq_lens, requests, \
                             num_requests, num_kv_heads, head_dim, head_dim_v, num_threads, BF16); \
}

DEFINE_ENTRY(prefill_attention_f32, float, 0)
DEFINE_ENTRY(prefill_attention_bf16, uint16_t, 1)

int64_t prefill_attention_max_head_dim(void) { return MAX_HEAD_DIM; }

/* Whether bfloat16 calls multiply through AMX tiles here, and allowing them or not (tests). */
int prefill_amx_ready(void) { return PREFILL_AMX && amx_ready(); }
void prefill_amx_allow(int allowed) { __atomic_store_n(&amx_allowed, allowed, __ATOMIC_RELAXED); }
