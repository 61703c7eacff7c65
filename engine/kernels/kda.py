"""Kimi delta attention's chunked rule over a packed batch, as one Triton kernel (CUDA):
the gated delta rule of kernels/delta_rule.py with a log-decay per key channel.

One program runs one request's tokens for one head and a block of value columns, a
chunk of CHUNK tokens at a time, keeping its block of the state S [K, BLOCK_V] in
registers (float32). With G_t [K] the chunk's cumulative log-decays up to token t
(the algebra of shardline.engine.recurrent.kda, its plain-torch reference):
    A_ts = sum_c k_t[c] k_s[c] e^(G_t[c] - G_s[c]),  Q_ts = the same with q_t, s <= t
    T = (I + strictly_lower(beta_t A_ts))^-1   (forward substitution)
    W = T (beta e^G * k),   U = T (beta v) - W S
    o = (e^G * q) S + Q U
    S <- diag(e^(G_C)) S + (e^(G_C - G) * k)^T U
The pairwise decays are built one row t at a time from e^(G_t - G_s) <= 1 (s <= t),
never as e^G_t times e^-G_s, which would overflow over a long chunk of strong decay.
Every product runs in float32 (IEEE, never TF32), as the Hugging Face module runs it.

Invariants: a chunk never holds two requests' tokens; slots past the request's end
load k = v = beta = g = 0, which writes nothing and decays nothing.

Layout (asserted by the launcher): q, k, g [T, H, K] and v [T, H, V] with unit last
stride; beta [T, H]; cu_seqlens [B+1] contiguous integers; initial_state [B, H, K, V].
"""

from __future__ import annotations

import torch

from ._triton import require_triton, tl, triton
from .delta_rule import (
    check_packed_layout,
    delta_rule_chunk_update,
    launch_chunked_rule,
    load_rows,
    state_block,
    unit_lower_inverse,
)

CHUNK = 32  # tokens per chunk on the GPU (a power of two, 16 at least: tl.dot's minimum)
MAX_BLOCK_V = 64  # value columns per program: the state block [K, BLOCK_V] stays in registers

if triton is not None:

    @triton.jit
    def pairwise_decayed_products(q, k, cum, CHUNK: tl.constexpr):
        """(A, Q) [CHUNK, CHUNK]: A[t, s] = sum_c k_t[c] k_s[c] e^(cum_t[c] - cum_s[c]) and
        Q[t, s] the same with q_t, for s <= t (zero above the diagonal)."""
        rows = tl.arange(0, CHUNK)
        key_pairs = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
        query_pairs = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
        for t in range(CHUNK):
            is_row = rows[:, None] == t
            k_t = tl.sum(tl.where(is_row, k, 0.0), axis=0)  # [K]
            q_t = tl.sum(tl.where(is_row, q, 0.0), axis=0)
            cum_t = tl.sum(tl.where(is_row, cum, 0.0), axis=0)
            earlier = (rows <= t)[:, None]  # [s, 1]
            # k_decayed [s, K]: k_s e^(G_t - G_s); key_row, query_row [s]. tl.sum's results
            # are typed as possibly a tl.tuple, whose indices are constexprs.
            k_decayed = k * tl.exp(tl.where(earlier, cum_t[None, :] - cum, 0.0))  # pyright: ignore[reportArgumentType]
            key_row = tl.sum(tl.where(earlier, k_decayed * k_t[None, :], 0.0), axis=1)  # pyright: ignore[reportArgumentType]
            query_row = tl.sum(tl.where(earlier, k_decayed * q_t[None, :], 0.0), axis=1)  # pyright: ignore[reportArgumentType]
            key_pairs = tl.where(is_row, key_row[None, :], key_pairs)  # pyright: ignore[reportArgumentType]
            query_pairs = tl.where(is_row, query_row[None, :], query_pairs)  # pyright: ignore[reportArgumentType]
        return key_pairs, query_pairs

    @triton.jit
    def _kda_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, cu_ptr, state_ptr,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
        stride_g_tok, stride_g_head, stride_beta_tok, stride_beta_head, stride_o_tok, stride_o_head,
        NUM_HEADS: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
        KEY_P: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
    ):
        request = tl.program_id(0)
        head = tl.program_id(1)
        key_cols = tl.arange(0, KEY_P)
        value_cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        key_ok = key_cols < KEY_DIM
        value_ok = value_cols < VALUE_DIM
        rows = tl.arange(0, CHUNK)
        strictly_causal = rows[None, :] < rows[:, None]  # [t, s]: s < t

        state_offs, state_mask = state_block(request, head, key_cols, value_cols, NUM_HEADS, KEY_DIM, VALUE_DIM)
        state = tl.load(state_ptr + state_offs, mask=state_mask, other=0.0)

        start = tl.load(cu_ptr + request).to(tl.int64)
        end = tl.load(cu_ptr + request + 1).to(tl.int64)
        for chunk_start in range(start, end, CHUNK):
            tokens = chunk_start + rows
            token_ok = tokens < end
            key_mask = token_ok[:, None] & key_ok[None, :]
            value_mask = token_ok[:, None] & value_ok[None, :]
            q = load_rows(q_ptr, tokens, stride_q_tok, head, stride_q_head, key_cols, key_mask)
            k = load_rows(k_ptr, tokens, stride_k_tok, head, stride_k_head, key_cols, key_mask)
            g = load_rows(g_ptr, tokens, stride_g_tok, head, stride_g_head, key_cols, key_mask)
            v = load_rows(v_ptr, tokens, stride_v_tok, head, stride_v_head, value_cols, value_mask)
            beta = tl.load(beta_ptr + tokens * stride_beta_tok + head * stride_beta_head, mask=token_ok,
                           other=0.0).to(tl.float32)

            cum = tl.cumsum(g, axis=0)  # [C, K]
            cum_end = tl.sum(g, axis=0)  # [K]
            key_pairs, attn = pairwise_decayed_products(q, k, cum, CHUNK)
            inverse = unit_lower_inverse(tl.where(strictly_causal, beta[:, None] * key_pairs, 0.0), CHUNK)
            growth = tl.exp(cum)
            out, state = delta_rule_chunk_update(  # cum_end: tl.sum's, typed as possibly a tl.tuple
                state, q * growth, k * tl.exp(cum_end[None, :] - cum), attn, inverse,  # pyright: ignore[reportArgumentType]
                beta[:, None] * k * growth, beta[:, None] * v, tl.exp(cum_end)[:, None])
            tl.store(out_ptr + tokens[:, None] * stride_o_tok + head * stride_o_head + value_cols[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=value_mask)
        tl.store(state_ptr + state_offs, state, mask=state_mask)


def chunk_kda_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor, initial_state: torch.Tensor, chunk: int = CHUNK,
                     block_v: int = MAX_BLOCK_V) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as shardline.engine.recurrent.kda.chunk_kda_varlen: q, k, g [T, H, K]
    (q, k normalised, q scaled); v [T, H, V]; beta [T, H]; initial_state [B, H, K, V],
    left unchanged. Returns (o [T, H, V] in v's dtype, the final states [B, H, K, V]
    float32). ``chunk`` and ``block_v`` (powers of two, 16 at least) are the most tokens
    per chunk and value columns per program."""
    require_triton()
    state = initial_state.to(torch.float32, copy=True).contiguous()
    check_packed_layout(q, k, v, g, beta, cu_seqlens, state, g_per_key=True)
    return launch_chunked_rule(_kda_kernel, q, k, v, g, beta, cu_seqlens, state, chunk, block_v)
