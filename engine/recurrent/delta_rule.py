"""The gated delta rule over a packed batch of requests, chunked, in plain torch.

Per value head the state S [K, V] maps keys to values; token t decays it and writes
the part of v_t that S does not already predict from k_t:
    S'_t = exp(g_t) S_{t-1},   u_t = beta_t (v_t - S'_t^T k_t),
    S_t = S'_t + k_t u_t^T,    o_t = S_t^T q_t.
Inside a chunk of C tokens with cumulative log-decay G_t (G relative to the chunk's
start), unrolling gives a unit lower-triangular system for the u's:
    u_t + beta_t sum_{s<t} e^{G_t-G_s} (k_t.k_s) u_s = beta_t v_t - beta_t e^{G_t} S_0^T k_t,
so u = U0 - W S_0 with U0, W solved once per chunk for all chunks at once (the
system's inverse by repeated squaring, a few batched matmuls: see
``unit_lower_inverse``), and
    o_t = e^{G_t} S_0^T q_t + sum_{s<=t} e^{G_t-G_s} (q_t.k_s) u_s,
    S_C = e^{G_C} S_0 + sum_s e^{G_C-G_s} k_s u_s^T.
Only the hand-over of S from one chunk to the next is sequential: one iteration
per chunk index, over every request that has a chunk there.

Invariants: every request's chunks start at its own first token, so no chunk holds
two requests' tokens; padding slots (at a chunk's end) carry beta = g = 0 and some
other token's finite q, k, v: zero beta zeroes their rows of the system (so u = 0
there) and zero g decays nothing, so they write nothing, no earlier token reads them
(causality), and a request's final state is its state after its last token.
"""

from __future__ import annotations

import torch

from ..kernels._triton import triton_available
from ..kernels.delta_rule import chunk_gated_delta_rule_triton
from ..kernels.delta_rule_step import delta_rule_step_triton
from .chunk_layout import ChunkLayout


def unit_lower_inverse(strictly_lower: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C]. A is nilpotent (A^C = 0),
    so (I + A)^-1 = sum_k (-A)^k = (I - A)(I + A^2)(I + A^4)...: log2(C) squarings and
    products, batched matmuls that run far faster than a batched triangular solve of
    small matrices, to the same accuracy."""
    size = strictly_lower.shape[-1]
    power = -strictly_lower
    result = torch.eye(size, dtype=power.dtype, device=power.device) + power
    covered = 2  # result holds the series up to power 2^j - 1
    while covered < size:
        power = power @ power
        result = result + result @ power
        covered *= 2
    return result


# Tokens per chunk. The within-chunk work per token grows with the chunk (the
# system's inverse is C x C), the sequential hand-over shrinks with it; 16 runs a
# CPU step's mixed prompts fastest (bench/bench_recurrent_kinds.py --delta-chunks).
CHUNK = 16


def chunk_gated_delta_rule_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor,
                                  chunk_size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key: [T, H, K] (normalised and scaled as the model does; heads already
    matched to the value heads); value: [T, H, V]; g (log decay), beta: [T, H];
    initial_state: [B, H, K, V] (zero for requests starting fresh), overwritten with each
    request's final state. Everything in one dtype, which the arithmetic runs in.
    Returns (output [T, H, V], the final states: initial_state itself)."""
    num_tokens = query.shape[0]
    if num_tokens == cu_seqlens.shape[0] - 1:  # one token per request: a decode step
        return gated_delta_rule_step(query, key, value, g, beta, initial_state)
    if query.is_cuda and triton_available() and initial_state.dtype == torch.float32:  # kernels/delta_rule.py
        return chunk_gated_delta_rule_triton(query, key, value, g, beta, cu_seqlens, initial_state)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    size = max(1, min(chunk_size, max_len))
    layout = ChunkLayout(cu_seqlens, size, num_tokens)
    # [N, H, C, D] / [N, H, C], contiguous so the batched matmuls below copy nothing.
    # Padding slots: beta = g = 0 (any finite q, k, v): see the module's invariants.
    q, k, v = (layout.gather_heads(x) for x in (query, key, value))
    g_chunks, beta_chunks = (layout.gather(x).transpose(1, 2).contiguous() for x in (g, beta))
    cum = torch.cumsum(g_chunks, dim=-1)
    causal = torch.ones(size, size, dtype=torch.bool, device=query.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(~causal, float("-inf")).exp_()  # [N, H, C, C]
    k_t = k.transpose(-1, -2)
    k_beta = k * beta_chunks[..., None]
    inverse = unit_lower_inverse((k_beta @ k_t).mul_(decay).tril_(-1))
    u = inverse @ (v * beta_chunks[..., None])  # U0 here; U0 - W S_0 after the hand-over
    w = inverse @ k_beta.mul_(cum.exp()[..., None])
    attn = (q @ k_t).mul_(decay)  # [N, H, C, C], diagonal included
    q_decayed = q.mul_(cum.exp()[..., None])
    k_to_end = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2).contiguous()  # [N, H, K, C]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [N, H, 1, 1]

    # The hand-over, one chunk index at a time: u = U0 - W S_0 and the entering state's
    # part of the outputs; then the chunks' own part, for all chunks at once.
    state = initial_state[layout.order]  # by rank: the requests with a chunk at index j lead
    out = torch.empty_like(u)
    for position in range(layout.max_chunks):
        chunks = layout.chunks_at(position)
        s0 = state[: chunks.stop - chunks.start]  # updated in place to the state leaving the chunk
        u[chunks] -= w[chunks] @ s0
        torch.matmul(q_decayed[chunks], s0, out=out[chunks])
        s0.mul_(chunk_decay[chunks]).flatten(0, 1).baddbmm_(k_to_end[chunks].flatten(0, 1),
                                                             u[chunks].flatten(0, 1))
    initial_state[layout.order] = state
    out.flatten(0, 1).baddbmm_(attn.flatten(0, 1), u.flatten(0, 1))
    return layout.scatter(out.transpose(1, 2)), initial_state


def gated_delta_rule_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests (the recurrence itself, batched): query, key
    [B, H, K], value [B, H, V], g, beta [B, H], state [B, H, K, V] updated in place.
    Returns (output [B, H, V], state)."""
    if query.is_cuda and triton_available() and state.dtype == query.dtype == torch.float32:  # delta_rule_step.py
        return delta_rule_step_triton(query, key, value, g, beta, state), state
    state.mul_(g.exp()[..., None, None])
    predicted = (key[..., None, :] @ state)[..., 0, :]  # [B, H, V]
    update = (value - predicted) * beta[..., None]
    state.add_(key[..., :, None] * update[..., None, :])
    return (query[..., None, :] @ state)[..., 0, :], state

