/* The chunked item of the decode attention (cpu_decode_attention.c), for float32 and
 * bfloat16 caches whose key and value head sizes are equal multiples of VL; the
 * kernel takes it for head sizes 64 and 128 (bfloat16: on 8-lane builds, AVX2 and narrower),
 * where the vector item's per-block softmax and value passes cost more than its reads.
 *
 * Where the vector item runs the online softmax per cache block (a max, an exp of
 * the correction and the accumulators rescaled every block_size keys, and the value
 * rows summed block by block), this one takes the context a chunk of up to
 * CHUNK_SCORES / (query rows) keys at a time, in two passes: every key's scores
 * first, then one softmax step over the chunk (its max, exp, sum; the accumulators
 * rescaled once), then the values. Contexts shorter than a chunk are a plain
 * softmax. The keys' and values' rows are read in place through the block table
 * (any block size), each once per pass:
 * - scores: VL consecutive keys at a time, their rows read one after another (each
 *   row's heads in memory order, all query rows of a head on the head's part), the
 *   VL partial sums of each query row then summed by sum_each as in the vector item; lanes
 *   before the window's first key or past the last one read the nearest key inside
 *   (never a row the request does not own) and are masked to -inf;
 * - values: one key's row at a time, in memory order as the scores read theirs, each
 *   KV head's part added to the accumulators of its query rows (COLS vectors of
 *   columns for two query rows at a time; the accumulators stay in L1 between keys).
 *   Each accumulator element sums its keys in key order, as a pass over the columns
 *   of a tile of keys would: the same products in the same order.
 * Both passes fetch the row PREFETCH_ROWS keys ahead into L1 and the row L2_ROWS
 * keys ahead into L2 as they reach a row: the hardware prefetchers alone leave the
 * loads waiting at every block, where the next row lies anywhere in memory, and the
 * arithmetic between the loads keeps fewer of them in flight than a plain read of the
 * rows has; the L2 requests keep more bytes in flight than L1's miss buffers hold.
 * A call whose rows could all be in L2 (the kernel's `cached`) makes no L2 requests:
 * where the rows are there, they are instructions for nothing.
 * Invariant: every row read or prefetched is one of the request's positions
 * first .. seq_len - 1. */

#ifndef SHARDLINE_CPU_DECODE_CHUNKED_H
#define SHARDLINE_CPU_DECODE_CHUNKED_H

#define CHUNK_SCORES 8192  /* floats of scores per item (32 KiB): keys per chunk x query rows */
#define MAX_CHUNK_KEYS 1024
/* keys ahead whose rows the passes prefetch; rows past a chunk's last key are looked up for them */
#define PREFETCH_ROWS 8
#define L2_ROWS 16
#define ROWS_PAST L2_ROWS

/* Bfloat16 caches are read 2 VL elements at a time, as one float32 vector of their
 * even elements and one of their odd ones (each bfloat16 the high half of a 32-bit
 * lane: two integer operations, where widening VL elements at a time takes a
 * widening load and a shift per vector). Queries and accumulators hold their head
 * dimension in that order (within each run of 2 VL: evens, then odds); the output
 * puts it back. The item's head sizes (64, 128) are multiples of COLS vectors, so every
 * value pass reads whole runs. */
static inline __attribute__((always_inline)) void load_bf16_pairs(const void *base, int64_t index, vf *even, vf *odd) {
    vi pairs;
    memcpy(&pairs, (const uint16_t *)base + index, sizeof pairs);
    *even = (vf)(pairs << 16);
    *odd = (vf)(pairs & ((vi){0} + (int32_t)0xffff0000u));
}

/* One scaled query row's products with the key head at element offset `row`, summed
 * over the head dimension a vector at a time (lane l: the sum over d = l mod VL;
 * sum_each finishes the dot products of VL keys at once). */
static inline __attribute__((always_inline)) vf key_dot(const float *query, const void *k_cache, int64_t row,
                                                        const int64_t D, const int bf16)
{
    vf a = splat(0.0f);
    for (int64_t d = 0; d < D; d += VL) {
        vf qd;
        memcpy(&qd, query + d, sizeof qd);
        if (bf16) {  /* qd: the even elements of d .. d + 2 VL - 1; the odd ones next */
            vf qo, even, odd;
            memcpy(&qo, query + d + VL, sizeof qo);
            load_bf16_pairs(k_cache, row + d, &even, &odd);
            a += qd * even + qo * odd;
            d += VL;
            continue;
        }
        a += qd * loadv(k_cache, row + d, bf16);
    }
    return a;
}

/* Prefetch into L1 (into L2 with to_l2) the bytes [0, size) from start, a 64-byte
 * line at a time. */
static inline __attribute__((always_inline)) void prefetch_run(const char *start, const int64_t size,
                                                                  const int to_l2) {
    for (int64_t byte = 0; byte < size; byte += 64) {
        if (to_l2)
            __builtin_prefetch(start + byte, 0, 1);
        else
            __builtin_prefetch(start + byte, 0, 3);
    }
}

/* acc0[0 .. COLS - 1] += q0 times the COLS vectors of the value row at element offset
 * `row`, and acc1's += q1 times them where pairs == 2. */
static inline __attribute__((always_inline)) void add_value_columns(vf *acc0, vf *acc1, float q0, float q1,
                                                                    const void *v_cache, int64_t row,
                                                                    const int pairs, const int bf16)
{
    vf v[COLS];
    if (bf16)
        for (int d = 0; d < COLS; d += 2) load_bf16_pairs(v_cache, row + VL * d, &v[d], &v[d + 1]);
    else
        for (int d = 0; d < COLS; d++) v[d] = loadv(v_cache, row + VL * d, 0);
    for (int d = 0; d < COLS; d++) acc0[d] += q0 * v[d];
    if (pairs == 2)
        for (int d = 0; d < COLS; d++) acc1[d] += q1 * v[d];
}

/* rows[j] for j < count: the element offset of key start + j's row (its item's first
 * head at `head`), the key clamped to [first, seq_len). One division per chunk. */
static inline void chunk_rows(int64_t *rows, int64_t count, int64_t start, int64_t first, int64_t seq_len,
                              const int32_t *table, int64_t block_size, int64_t row_stride, int64_t head)
{
    const int64_t lo = first > start ? first - start : 0;
    const int64_t hi = seq_len - start < count ? seq_len - start : count;
    int64_t block = (start + lo) / block_size, offset = (start + lo) % block_size;
    for (int64_t j = lo; j < hi; j++) {
        rows[j] = ((int64_t)table[block] * block_size + offset) * row_stride + head;
        if (++offset == block_size) {
            offset = 0;
            block++;
        }
    }
    for (int64_t j = 0; j < lo; j++) rows[j] = rows[lo];
    for (int64_t j = hi; j < count; j++) rows[j] = rows[hi - 1];
}

static inline __attribute__((always_inline)) void chunked_item(
    const void *q, int64_t q_stride_t, int64_t q_stride_h, const void *k_cache, const void *v_cache,
    const int32_t *table, int64_t seq_len, int64_t query_row, void *out, int64_t h0, int64_t num_item_heads,
    int64_t group, int64_t num_heads, int64_t row_stride, const int64_t D, int64_t block_size, float scale,
    int64_t window, float softcap, const double *sinks, const double *alibi, int64_t chunk, int cached,
    const int bf16)
{
    /* Rows i = 0 .. n-1 are the item's query heads h0 * group + i; row i reads KV head h0 + i / group. */
    const int64_t n = num_item_heads * group, DV = D / VL, query_pos = seq_len - 1;
    const int64_t element = bf16 ? 2 : 4;
    int64_t first = (window > 0 && seq_len > window) ? seq_len - window : 0;
    if (chunk > 0 && query_pos - query_pos % chunk > first) first = query_pos - query_pos % chunk;
    /* Keys per chunk: a multiple of VL, at least 128 (n <= 64) */
    const int64_t chunk_keys = (CHUNK_SCORES / n < MAX_CHUNK_KEYS ? CHUNK_SCORES / n : MAX_CHUNK_KEYS) / VL * VL;
    const int64_t run_bytes = num_item_heads * D * element;  /* the item's part of a key or value row */
    float qs[MAX_ITEM_HEADS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    vf acc[MAX_ITEM_HEADS][MAX_HEAD_DIM / VL];
    float m[MAX_ITEM_HEADS], l[MAX_ITEM_HEADS];
    float p[CHUNK_SCORES] __attribute__((aligned(64)));  /* p[i * chunk_keys + key - start] */
    int64_t rows[MAX_CHUNK_KEYS + VL + ROWS_PAST];  /* row offsets */
    vf partial[MAX_ITEM_HEADS][VL];  /* partial[i][r]: query row i's products with key j0 + r, summed over VL lanes */
    for (int64_t i = 0; i < n; i++) {
        const int64_t qh = query_row * q_stride_t + (h0 * group + i) * q_stride_h;
        for (int64_t d = 0; d < D; d++)  /* bfloat16: evens then odds of each 2 VL (load_bf16_pairs) */
            qs[i][bf16 ? d - d % (2 * VL) + d % 2 * VL + d % (2 * VL) / 2 : d] = load1(q, qh + d, bf16) * scale;
        for (int64_t d = 0; d < DV; d++) acc[i][d] = splat(0.0f);
        m[i] = sinks ? (float)sinks[h0 * group + i] : -INFINITY;
        l[i] = sinks ? 1.0f : 0.0f;
    }
    const int pairs = group % 2 == 0 ? 2 : 1;
    for (int64_t start = first - first % VL; start < seq_len; start += chunk_keys) {
        const int64_t end = start + chunk_keys < seq_len ? start + chunk_keys : seq_len;
        const int64_t span = end - start, padded = (span + VL - 1) / VL * VL;
        /* Each key's row (element offset of its item's first head), clamped to [first, seq_len),
         * and ROWS_PAST more past the chunk (clamped too) for the prefetches. */
        chunk_rows(rows, padded + ROWS_PAST, start, first, seq_len, table, block_size, row_stride, h0 * D);
        for (int64_t j0 = 0; j0 < padded; j0 += VL) {
            /* The VL keys' rows one after another, each row's heads in memory order: a
             * sequential read the hardware prefetchers follow, where reading each head's
             * part of the VL rows in turn is a strided walk they do not. */
            for (int r = 0; r < VL; r++) {
                prefetch_run((const char *)k_cache + rows[j0 + r + PREFETCH_ROWS] * element, run_bytes, 0);
                if (!cached) prefetch_run((const char *)k_cache + rows[j0 + r + L2_ROWS] * element, run_bytes, 1);
                for (int64_t kv = 0; kv < num_item_heads; kv++)
                    for (int64_t i = kv * group; i < (kv + 1) * group; i++)
                        partial[i][r] = key_dot(qs[i], k_cache, rows[j0 + r] + kv * D, D, bf16);
            }
            for (int64_t i = 0; i < n; i++) {
                const vf s = sum_each(partial[i]);
                memcpy(&p[i * chunk_keys + j0], &s, sizeof s);
            }
        }
        for (int64_t i = 0; i < n; i++) {
            float *pi = p + i * chunk_keys;
            const float slope = alibi ? (float)alibi[h0 * group + i] : 0.0f;
            vf block_max = splat(-INFINITY);
            for (int64_t j0 = 0; j0 < padded; j0 += VL) {
                const vf key = (vf)LANE_INDICES + (float)(start + j0);
                vf s;
                memcpy(&s, pi + j0, sizeof s);
                if (alibi) s += slope * (key - (float)query_pos);
                if (softcap > 0) s = softcap * vtanh(s * (1.0f / softcap));
                s = blend((key < (float)first) | (key > (float)query_pos), splat(-INFINITY), s);
                memcpy(pi + j0, &s, sizeof s);
                block_max = vmax(block_max, s);
            }
            const float new_max = hmax(block_max) > m[i] ? hmax(block_max) : m[i];
            const float correction = exp_f32(m[i] - new_max);
            vf sum = splat(0.0f);
            for (int64_t j0 = 0; j0 < padded; j0 += VL) {
                vf s;
                memcpy(&s, pi + j0, sizeof s);
                s = vexp(s - new_max);  /* masked keys: exactly 0 */
                memcpy(pi + j0, &s, sizeof s);
                sum += s;
            }
            l[i] = l[i] * correction + hsum(sum);
            m[i] = new_max;
            if (correction != 1.0f)
                for (int64_t d = 0; d < DV; d++) acc[i][d] *= correction;
        }
        /* The values of keys lo .. span - 1 of the chunk (those before `first` are masked),
         * one row after another, each row's heads in memory order. */
        const int64_t lo = first > start ? first - start : 0;
        for (int64_t j = lo; j < span; j++) {
            prefetch_run((const char *)v_cache + rows[j + PREFETCH_ROWS] * element, run_bytes, 0);
            if (!cached) prefetch_run((const char *)v_cache + rows[j + L2_ROWS] * element, run_bytes, 1);
            for (int64_t kv = 0; kv < num_item_heads; kv++)
                for (int64_t i = kv * group; i < (kv + 1) * group; i += pairs) {
                    const float q0 = p[i * chunk_keys + j], q1 = pairs == 2 ? p[(i + 1) * chunk_keys + j] : 0.0f;
                    for (int64_t c = 0; c < DV; c += COLS)
                        add_value_columns(&acc[i][c], pairs == 2 ? &acc[i + 1][c] : NULL, q0, q1, v_cache,
                                          rows[j] + kv * D + VL * c, pairs, bf16);
                }
        }
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t o = (query_row * num_heads + h0 * group + i) * D;
        const float inverse = l[i] > 0 ? 1.0f / l[i] : 0.0f;
        for (int64_t d = 0; d < DV; d += 2) {
            const vf even = acc[i][d] * inverse, odd = acc[i][d + 1] * inverse;
            storev(out, o + VL * d, bf16 ? SHUFFLE2(even, odd, ZIP_LOW) : even, bf16);
            storev(out, o + VL * (d + 1), bf16 ? SHUFFLE2(even, odd, ZIP_HIGH) : odd, bf16);
        }
    }
}

_Static_assert(64 / VL % COLS == 0, "the value pass adds whole runs of COLS vectors of a head of 64 or 128");

/* The chunked item for one element type and head size (keys and values), as its own
 * function: its work arrays in their own stack frame. */
#define DEFINE_CHUNKED_ITEM(NAME, BF16, HEAD_DIM)                                                         \
static __attribute__((noinline)) void NAME(                                                     \
    const void *q, int64_t q_stride_t, int64_t q_stride_h, const void *k_cache, const void *v_cache, \
    const int32_t *table, int64_t seq_len, int64_t query_row, void *out, int64_t h0,             \
    int64_t num_item_heads, int64_t group, int64_t num_heads, int64_t row_stride, int64_t block_size, \
    float scale, int64_t window, float softcap, const double *sinks, const double *alibi, int64_t chunk, \
    int cached)                                                                                 \
{                                                                                               \
    chunked_item(q, q_stride_t, q_stride_h, k_cache, v_cache, table, seq_len, query_row, out, h0, \
                 num_item_heads, group, num_heads, row_stride, HEAD_DIM, block_size, scale, window, softcap, \
                 sinks, alibi, chunk, cached, BF16);                                            \
}

DEFINE_CHUNKED_ITEM(chunked_item_64_f32, 0, 64)
DEFINE_CHUNKED_ITEM(chunked_item_64_bf16, 1, 64)
DEFINE_CHUNKED_ITEM(chunked_item_128_f32, 0, 128)
DEFINE_CHUNKED_ITEM(chunked_item_128_bf16, 1, 128)

#endif
