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
two requests' tokens; padding slots carry k = v = beta = g = 0, which writes nothing
and decays nothing, so a request's final state is its state after its last token.
"""

from __future__ import annotations

import torch

from ..kernels._triton import triton_available
from ..kernels.delta_rule import chunk_gated_delta_rule_triton


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class ChunkLayout:
    """The step's requests cut into chunks of ``chunk_size`` tokens, ordered so the
    sequential hand-over reads slices, not gathers: requests are ranked by their chunk
    count, most first (``order``: rank -> request), and the chunks are laid out chunk
    index first, then rank. So the requests with a chunk at index j are ranks
    [0, active[j]) and their chunks are ``offset[j] + rank``. ``token_index`` [N, C]
    holds each chunk slot's packed token (``num_tokens`` for padding)."""

    def __init__(self, cu_seqlens: torch.Tensor, chunk_size: int, num_tokens: int) -> None:
        device = cu_seqlens.device
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        chunks_per_request = (lengths + chunk_size - 1) // chunk_size
        num_requests = lengths.shape[0]
        self.num_chunks = int(chunks_per_request.sum())
        self.max_chunks = int(chunks_per_request.max()) if num_requests else 0
        self.order = torch.argsort(chunks_per_request, descending=True, stable=True)
        rank = torch.empty_like(self.order)
        rank[self.order] = torch.arange(num_requests, device=device)
        active = (chunks_per_request[:, None] > torch.arange(self.max_chunks, device=device)).sum(0)
        self.active = active.tolist()
        offset = torch.cumsum(active, 0) - active
        self.offsets = offset.tolist()
        request = torch.repeat_interleave(torch.arange(num_requests, device=device), chunks_per_request,
                                          output_size=self.num_chunks)
        first_chunk = torch.cumsum(chunks_per_request, 0) - chunks_per_request
        local = torch.arange(self.num_chunks, device=device) - first_chunk[request]
        starts = cu_seqlens[:-1][request] + local * chunk_size
        index = starts[:, None] + torch.arange(chunk_size, device=device)
        valid = index < cu_seqlens[1:][request][:, None]
        position = offset[local] + rank[request]  # each chunk's place in the layout
        self.valid = torch.empty_like(valid)
        self.valid[position] = valid
        self.token_index = torch.empty_like(index)
        self.token_index[position] = torch.where(valid, index, num_tokens)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [N, C, ...], zero in padding slots."""
        padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
        return padded[self.token_index]

    def scatter(self, chunks: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[N, C, ...] -> [T, ...], the valid slots."""
        out = chunks.new_empty((num_tokens, *chunks.shape[2:]))
        out[self.token_index[self.valid]] = chunks[self.valid]
        return out


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


def chunk_gated_delta_rule_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor,
                                  chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
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
    # [N, H, C, D] / [N, H, C]
    q, k, v = (layout.gather(x).transpose(1, 2) for x in (query, key, value))
    g_chunks, beta_chunks = (layout.gather(x).transpose(1, 2) for x in (g, beta))
    cum = torch.cumsum(g_chunks, dim=-1)
    causal = torch.ones(size, size, dtype=torch.bool, device=query.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [N, H, C, C]
    k_beta = k * beta_chunks[..., None]
    inverse = unit_lower_inverse(((k_beta @ k.transpose(-1, -2)) * decay).tril(-1))
    u0 = inverse @ (v * beta_chunks[..., None])
    w = inverse @ (k_beta * cum.exp()[..., None])
    attn = (q @ k.transpose(-1, -2)) * decay  # [N, H, C, C], diagonal included
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [N, H, 1, 1]

    state = initial_state[layout.order]  # by rank: the requests with a chunk at index j lead
    out = torch.empty_like(v)
    for active, offset in zip(layout.active, layout.offsets):
        chunks = slice(offset, offset + active)
        s0 = state[:active]
        u = u0[chunks] - w[chunks] @ s0
        out[chunks] = q_decayed[chunks] @ s0 + attn[chunks] @ u
        state[:active] = s0 * chunk_decay[chunks] + k_to_end[chunks].transpose(-1, -2) @ u
    initial_state[layout.order] = state
    return layout.scatter(out.transpose(1, 2), num_tokens), initial_state


def gated_delta_rule_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests (the recurrence itself, batched): query, key
    [B, H, K], value [B, H, V], g, beta [B, H], state [B, H, K, V] updated in place.
    Returns (output [B, H, V], state)."""
    state.mul_(g.exp()[..., None, None])
    predicted = (key[..., None, :] @ state)[..., 0, :]  # [B, H, V]
    update = (value - predicted) * beta[..., None]
    state.add_(key[..., :, None] * update[..., None, :])
    return (query[..., None, :] @ state)[..., 0, :], state


def gated_delta_rule_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, token by token (the recurrence in the module docstring):
    query, key [L, H, K], value [L, H, V], g, beta [L, H], initial_state [H, K, V] or None."""
    num_heads, k_dim, v_dim = key.shape[1], key.shape[2], value.shape[2]
    state = (initial_state.clone() if initial_state is not None
             else value.new_zeros((num_heads, k_dim, v_dim)))
    outputs = []
    for t in range(query.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = (state * key[t][:, :, None]).sum(1)  # [H, V]
        update = (value[t] - predicted) * beta[t][:, None]
        state = state + key[t][:, :, None] * update[:, None, :]
        outputs.append((state * query[t][:, :, None]).sum(1))
    return torch.stack(outputs), state
