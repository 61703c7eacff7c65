"""One decode token per request through the gated delta rule, as one Triton kernel
(CUDA): the recurrence itself, for the gated delta-net (one log-decay per head) and
Kimi delta attention (one per key channel).

One program updates one request's state block S [K, BLOCK_V] for one head, in
registers (float32):
    S <- diag(e^g) S,   u = beta (v - S^T k),   S <- S + k u^T,   o = S^T q
The plain-torch references are recurrent_reference.py's gated_delta_rule_reference (one
request, token by token) and kda_step_reference.

Layout (asserted by the launcher): q, k [B, H, K] and v [B, H, V] with unit last
stride; g [B, H] or, per key channel, [B, H, K] with unit last stride; beta [B, H];
state [B, H, K, V] contiguous float32, updated in place.
"""

from __future__ import annotations

import torch

from ._triton import launcher, next_power_of_2, require_triton, tl, triton
from .delta_rule import check_packed_layout

MAX_BLOCK_V = 64  # value columns per program

if triton is not None:

    @triton.jit
    def _delta_rule_step_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr,
        stride_q_req, stride_q_head, stride_k_req, stride_k_head, stride_v_req, stride_v_head,
        stride_g_req, stride_g_head, stride_beta_req, stride_beta_head, stride_o_req, stride_o_head,
        NUM_HEADS: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
        KEY_P: tl.constexpr, BLOCK_V: tl.constexpr, G_PER_KEY: tl.constexpr,
    ):
        request = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        key_cols = tl.arange(0, KEY_P)
        value_cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        key_ok = key_cols < KEY_DIM
        value_ok = value_cols < VALUE_DIM
        state_offs = ((request * NUM_HEADS + head) * KEY_DIM * VALUE_DIM
                      + key_cols[:, None] * VALUE_DIM + value_cols[None, :])
        state_mask = key_ok[:, None] & value_ok[None, :]
        state = tl.load(state_ptr + state_offs, mask=state_mask, other=0.0)

        q = tl.load(q_ptr + request * stride_q_req + head * stride_q_head + key_cols, mask=key_ok,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + request * stride_k_req + head * stride_k_head + key_cols, mask=key_ok,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + request * stride_v_req + head * stride_v_head + value_cols, mask=value_ok,
                    other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + request * stride_beta_req + head * stride_beta_head).to(tl.float32)
        if G_PER_KEY:
            g = tl.load(g_ptr + request * stride_g_req + head * stride_g_head + key_cols, mask=key_ok,
                        other=0.0).to(tl.float32)
            state = state * tl.exp(g)[:, None]
        else:
            g = tl.load(g_ptr + request * stride_g_req + head * stride_g_head).to(tl.float32)
            state = state * tl.exp(g)
        predicted = tl.sum(state * k[:, None], axis=0)  # [BLOCK_V]
        update = (v - predicted) * beta
        state = state + k[:, None] * update[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + request * stride_o_req + head * stride_o_head + value_cols,
                 out.to(out_ptr.dtype.element_ty), mask=value_ok)
        tl.store(state_ptr + state_offs, state, mask=state_mask)


def delta_rule_step_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, block_v: int = MAX_BLOCK_V) -> torch.Tensor:
    """One token for each of B requests: query, key [B, H, K]; value [B, H, V]; g [B, H]
    (gated delta-net) or [B, H, K] (Kimi delta attention); beta [B, H]; state
    [B, H, K, V] float32, updated in place. Returns the output [B, H, V] in value's dtype."""
    require_triton()
    num_requests, num_heads, key_dim = query.shape
    value_dim = value.shape[2]
    g_per_key = g.dim() == 3
    one_token_each = torch.arange(num_requests + 1, device=query.device)
    check_packed_layout(query, key, value, g, beta, one_token_each, state, g_per_key=g_per_key)
    out = torch.empty((num_requests, num_heads, value_dim), dtype=value.dtype, device=value.device)
    if num_requests == 0:
        return out
    block_v = min(block_v, next_power_of_2(value_dim))
    grid = (num_requests, num_heads, triton.cdiv(value_dim, block_v))
    launcher(_delta_rule_step_kernel, grid)(
        query, key, value, g, beta, out, state,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, KEY_DIM=key_dim, VALUE_DIM=value_dim,
        KEY_P=next_power_of_2(key_dim), BLOCK_V=block_v, G_PER_KEY=g_per_key,
    )
    return out
