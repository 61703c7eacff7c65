"""Paged attention over a packed varlen batch: prefill chunks and decode in one launch.

There is no prefill or decode kernel: a sequence contributes q_len >= 1 new query
tokens, which are the last q_len positions of its context of seq_len tokens, so query
token i sits at position seq_len - q_len + i. Every query attends causally to the
whole context (cached prefix plus the new tokens, already stored in the cache).

Kernel design: one program per (sequence, query tile, kv head). The query tile holds
BLOCK_Q tokens x all the query heads sharing that kv head, flattened into BLOCK_M rows
(row = token * GROUP_P + head in group), so under GQA each K/V tile is loaded once
for the whole group and decode (q_len 1) still fills the >= 16 rows tl.dot needs.
The program walks the context in BLOCK_N-key tiles, gathering each key's slot through
the block table (so a tile may span pages, or a page several tiles), and keeps an
online softmax (running max m, running sum l, unnormalised accumulator) in float32.
Tiles entirely before the sliding window (or the chunk) of the tile's first query are
never visited.

The AttentionOptions of engine/attention/context.py, each a compile-time switch so
an option that is off costs nothing: a sink starts a row's online softmax (running
max = the sink's logit, running sum = 1, nothing accumulated); ALiBi adds
slope_h * (key - query position) to the scaled scores; a chunk hides keys before the
query's aligned chunk. Values may have their own head size (Dv): the accumulator and
the output are [M, Dv].
"""

from __future__ import annotations

import torch

from ._triton import (
    check_kernel_dtype,
    interpreter_active,
    launcher,
    next_power_of_2,
    require_triton,
    tl,
    triton,
)

MAX_HEAD_DIM = 256

if triton is not None:

    @triton.jit
    def _attend_key_tile(
        q, acc, m_i, l_i, q_pos, slopes, tile_start, kv_end, kv_head,
        k_cache_ptr, v_cache_ptr, block_table,
        scale, softcap, sliding_window, chunk_size,
        stride_cache_block, stride_cache_slot, stride_cache_head,
        stride_v_block, stride_v_slot, stride_v_head,
        dims, dim_valid, dims_v, dim_v_valid,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
        USE_ALIBI: tl.constexpr, USE_CHUNK: tl.constexpr,
        DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    ):
        """One online-softmax step over keys [tile_start, tile_start + BLOCK_N)."""
        # q: [M, Dp]; acc: [M, Dvp] float32; m_i, l_i, q_pos, slopes: [M]
        key_pos = tile_start + tl.arange(0, BLOCK_N)  # [N]
        key_valid = key_pos < kv_end
        block_id = tl.load(block_table + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        block_id = block_id.to(tl.int64)
        slot = key_pos % BLOCK_SIZE
        slot_offs = block_id * stride_cache_block + slot * stride_cache_slot + kv_head * stride_cache_head
        k_offs = dims[:, None] + slot_offs[None, :]  # [Dp, N]: keys loaded transposed
        k_mask = dim_valid[:, None] & key_valid[None, :]
        k_t = tl.load(k_cache_ptr + k_offs, mask=k_mask, other=0.0).to(DOT_DTYPE)

        scores = tl.dot(q, k_t, input_precision=INPUT_PRECISION) * scale  # [M, N]
        if USE_ALIBI:
            scores += slopes[:, None] * (key_pos[None, :] - q_pos[:, None]).to(tl.float32)
        if USE_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 without overflow nan.
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        visible = key_valid[None, :] & (key_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - key_pos[None, :] < sliding_window)
        if USE_CHUNK:
            visible = visible & (key_pos[None, :] >= (q_pos - q_pos % chunk_size)[:, None])
        scores = tl.where(visible, scores * 1.4426950408889634, float("-inf"))  # log2 units

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_slot_offs = block_id * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
        v_offs = v_slot_offs[:, None] + dims_v[None, :]  # [N, Dvp]
        v_mask = key_valid[:, None] & dim_v_valid[None, :]
        v = tl.load(v_cache_ptr + v_offs, mask=v_mask, other=0.0).to(DOT_DTYPE)
        # DOT_DTYPE, annotated tl.constexpr as Triton requires, holds a tl.dtype when compiled
        acc = tl.dot(p.to(DOT_DTYPE), v, acc=acc * alpha[:, None],  # pyright: ignore[reportArgumentType]
                     input_precision=INPUT_PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _paged_attention_kernel(
        o_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr, slopes_ptr,
        scale, softcap, sliding_window, chunk_size,
        stride_q_token, stride_q_head, stride_o_token, stride_o_head,
        stride_cache_block, stride_cache_slot, stride_cache_head,
        stride_v_block, stride_v_slot, stride_v_head, stride_block_table,
        QUERIES_PER_KV: tl.constexpr, GROUP_P: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
        USE_SINKS: tl.constexpr, USE_ALIBI: tl.constexpr, USE_CHUNK: tl.constexpr,
        DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        first_q = tl.program_id(1) * BLOCK_Q
        kv_head = tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if first_q >= q_len:  # the grid covers the longest query; shorter ones stop here
            return
        context_len = tl.load(seq_lens_ptr + seq) - q_len

        # Row r of the tile is query token first_q + r // GROUP_P, head r % GROUP_P of
        # this kv head's group; rows past q_len or past the group are padding.
        rows = tl.arange(0, BLOCK_M)
        q_idx = first_q + rows // GROUP_P  # [M] query token within the sequence
        head_in_group = rows % GROUP_P
        row_valid = (q_idx < q_len) & (head_in_group < QUERIES_PER_KV)
        q_pos = context_len + q_idx  # [M] position in the context
        head = kv_head * QUERIES_PER_KV + head_in_group
        dims = tl.arange(0, HEAD_DIM_P)
        dim_valid = dims < HEAD_DIM
        q_offs = ((q_start + q_idx).to(tl.int64) * stride_q_token)[:, None] \
            + (head * stride_q_head)[:, None] + dims[None, :]
        q_mask = row_valid[:, None] & dim_valid[None, :]
        q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(DOT_DTYPE)  # [M, Dp]

        # Keys [kv_begin, kv_end) can be visible to some row of this tile; with a
        # window or chunks, tiles wholly before the first row's are skipped.
        kv_end = context_len + tl.minimum(q_len, first_q + BLOCK_Q)
        kv_begin = 0
        if USE_WINDOW:
            kv_begin = tl.maximum(context_len + first_q - sliding_window + 1, 0)
        if USE_CHUNK:
            first_pos = context_len + first_q
            kv_begin = tl.maximum(kv_begin, first_pos - first_pos % chunk_size)
        kv_begin = (kv_begin // BLOCK_N) * BLOCK_N

        # m starts finite so a row that sees no key in a tile gives exp2(-inf) = 0, not nan.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if USE_SINKS:  # the sink's logit, in log2 units, is the first term of the softmax
            sinks = tl.load(sinks_ptr + head, mask=row_valid, other=0.0)
            m_i = tl.where(row_valid, sinks * 1.4426950408889634, m_i)
            l_i = tl.where(row_valid, 1.0, l_i)
        slopes = l_i  # unused unless USE_ALIBI
        if USE_ALIBI:
            slopes = tl.load(slopes_ptr + head, mask=row_valid, other=0.0)
        dims_v = tl.arange(0, HEAD_DIM_V_P)
        dim_v_valid = dims_v < HEAD_DIM_V
        acc = tl.zeros([BLOCK_M, HEAD_DIM_V_P], dtype=tl.float32)
        block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_table
        for tile_start in range(kv_begin, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_key_tile(
                q, acc, m_i, l_i, q_pos, slopes, tile_start, kv_end, kv_head,
                k_cache_ptr, v_cache_ptr, block_table, scale, softcap, sliding_window, chunk_size,
                stride_cache_block, stride_cache_slot, stride_cache_head,
                stride_v_block, stride_v_slot, stride_v_head, dims, dim_valid, dims_v, dim_v_valid,
                BLOCK_SIZE, BLOCK_N, USE_SOFTCAP, USE_WINDOW, USE_ALIBI, USE_CHUNK, DOT_DTYPE, INPUT_PRECISION,
            )

        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only; they are not stored
        out = acc / l_i[:, None]
        o_offs = ((q_start + q_idx).to(tl.int64) * stride_o_token)[:, None] \
            + (head * stride_o_head)[:, None] + dims_v[None, :]
        o_mask = row_valid[:, None] & dim_v_valid[None, :]
        tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=o_mask)

def _check_layout(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables) -> None:
    assert q.dim() == 3 and q.stride(2) == 1, "q must be [T, H, D] with contiguous D"
    assert k_cache.dim() == 4 and v_cache.dim() == 4 and k_cache.shape[:3] == v_cache.shape[:3], (
        f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads, cache_head_dim = k_cache.shape[1:]
    assert head_dim == cache_head_dim, f"q head_dim {head_dim} != cache {cache_head_dim}"
    assert max(head_dim, v_cache.shape[3]) <= MAX_HEAD_DIM, (
        f"head sizes {head_dim}, {v_cache.shape[3]} > {MAX_HEAD_DIM}")
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads, {num_kv_heads} kv heads"
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} is not a power of 2"
    assert q.dtype == k_cache.dtype == v_cache.dtype, (
        f"dtypes differ: q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype}"
    )
    num_seqs = seq_lens.shape[0]
    assert seq_lens.dtype == torch.int32 and seq_lens.dim() == 1, "seq_lens: int32 [B]"
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,), (
        f"query_start_loc must be int32 [B+1={num_seqs + 1}], got {query_start_loc.dtype} "
        f"{tuple(query_start_loc.shape)}"
    )
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2, "block_tables: int32 2-D"
    assert block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1, (
        f"block_tables must be [B={num_seqs}, max_blocks] with contiguous rows"
    )
    tensors = (q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"tensors on several devices: {devices}"


def _check_options(sliding_window, softcap, chunk_size) -> None:
    for name, value in (("sliding_window", sliding_window), ("chunk_size", chunk_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r}; expected None or an int >= 1")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap!r}; expected None or a float > 0")


def _per_head(values: torch.Tensor | None, q: torch.Tensor, name: str) -> torch.Tensor | None:
    """A per-head option as the kernel reads it: [H] contiguous float32 on q's device."""
    if values is None:
        return None
    assert values.shape == (q.shape[1],), f"{name} {tuple(values.shape)}, expected [{q.shape[1]}]"
    return values.detach().to(device=q.device, dtype=torch.float32).contiguous()


def _dot_dtype(dtype: torch.dtype):
    # The interpreter stores bfloat16 as raw uint16 and cannot multiply it, so there
    # bfloat16 tiles are upcast and the dots run in float32; float16 keeps its dot.
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and not interpreter_active():
        return tl.bfloat16
    return tl.float32


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    chunk_size: int | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Attention of the packed queries over their paged contexts; returns o [T, H, Dv].

    The new tokens' keys and values must already be in the cache (store_kv_cache).
    max_query_len sizes the grid; when None it is read from query_start_loc (a host
    sync). Rows of o past query_start_loc[-1] are left unwritten. sinks,
    alibi_slopes ([H]) and chunk_size as engine/attention/context.py's AttentionOptions.
    """
    # q: [T, H, D]; k_cache: [NB, BS, Hkv, D]; v_cache: [NB, BS, Hkv, Dv];
    # query_start_loc: [B+1] int32; seq_lens: [B] int32; block_tables: [B, max_blocks] int32
    require_triton()
    check_kernel_dtype("q", q)
    _check_layout(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    _check_options(sliding_window, softcap, chunk_size)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    head_dim_v = v_cache.shape[3]
    sinks, alibi_slopes = _per_head(sinks, q, "sinks"), _per_head(alibi_slopes, q, "alibi_slopes")
    o = torch.empty((num_tokens, num_heads, head_dim_v), dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max()) if num_seqs else 0
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return o

    queries_per_kv = num_heads // num_kv_heads
    group_p = next_power_of_2(queries_per_kv)
    # Decode-only batches get 16-row tiles (tl.dot's minimum), prefill 64 rows.
    target_rows = 16 if max_query_len * group_p <= 16 else 64
    block_q = max(1, target_rows // group_p)
    block_m = max(16, block_q * group_p)
    head_dim_p = max(16, next_power_of_2(head_dim))
    head_dim_v_p = max(16, next_power_of_2(head_dim_v))
    block_n = 64 if max(head_dim_p, head_dim_v_p) <= 128 else 32
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    launcher(_paged_attention_kernel, grid)(
        o, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
        q if sinks is None else sinks, q if alibi_slopes is None else alibi_slopes,  # q: never read
        float(scale), float(softcap or 0.0), int(sliding_window or 0), int(chunk_size or 0),
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv, GROUP_P=group_p,
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, HEAD_DIM_V=head_dim_v, HEAD_DIM_V_P=head_dim_v_p,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
        USE_SINKS=sinks is not None, USE_ALIBI=alibi_slopes is not None, USE_CHUNK=chunk_size is not None,
        DOT_DTYPE=_dot_dtype(q.dtype),
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if block_m * max(head_dim_p, head_dim_v_p) >= 64 * 256 else 4,
    )
    return o


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    chunk_size: int | None = None,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch paged_attention, one sequence at a time; rows past the last query are 0.
    The options as engine/attention/context.py's AttentionOptions: ALiBi's
    slope_h * (key - query position) is added to the scaled score before the softcap;
    a sink is one more softmax logit per head attending to no value; a chunked query
    sees keys from the start of its aligned chunk. key_limits: [T], the last key each
    query row sees (StepBatch.key_limits), or None: its own position."""
    # q: [T, H, D]; k_cache: [NB, BS, Hkv, D]; v_cache: [NB, BS, Hkv, Dv]; returns [T, H, Dv]
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1:3]
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    flat_k = k_cache.reshape(-1, *k_cache.shape[2:])  # [NB * BS, Hkv, D]
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:])
    o = q.new_zeros((*q.shape[:2], v_cache.shape[3]))
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[seq], starts[seq + 1]
        if q_end == q_start:
            continue
        key_pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[seq, key_pos // block_size].long() * block_size + key_pos % block_size
        k = flat_k[slots].repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, H, D]
        v = flat_v[slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].to(compute_dtype),
                              k.to(compute_dtype)) * scale  # [H, q_len, S]
        q_pos = key_pos[seq_len - (q_end - q_start):]
        if alibi_slopes is not None:
            distance = (key_pos[None, :] - q_pos[:, None]).to(compute_dtype)
            scores = scores + alibi_slopes.to(compute_dtype)[:, None, None] * distance
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        last = q_pos if key_limits is None else key_limits[q_start:q_end].to(key_pos.device)
        visible = key_pos[None, :] <= last[:, None]
        if sliding_window is not None:
            visible &= q_pos[:, None] - key_pos[None, :] < sliding_window
        if chunk_size is not None:
            visible &= key_pos[None, :] >= (q_pos - q_pos % chunk_size)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_column = sinks.to(compute_dtype)[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, v.to(compute_dtype))
        o[q_start:q_end] = out.to(q.dtype)
    return o
