"""The chunked gated delta rule over a packed batch, as one Triton kernel (CUDA).

One program runs one request's tokens for one head and a block of value columns, a
chunk of CHUNK tokens at a time, keeping its block of the state S [K, BLOCK_V] in
registers (float32). With G_t the chunk's cumulative log-decay up to token t (the
algebra of shardline.engine.recurrent.delta_rule, its plain-torch reference):
    T = (I + strictly_lower(beta_t e^(G_t - G_s) k_t.k_s))^-1   (forward substitution)
    W = T (beta e^G k),   U = T (beta v) - W S
    o = (e^G q) S + causal(e^(G_t - G_s) q_t.k_s) U
    S <- e^(G_C) S + (e^(G_C - G) k)^T U
Every product runs in float32 (IEEE, never TF32), whatever the inputs' dtype, so the
kernel agrees with the float32 torch path to rounding.

Invariants: a chunk never holds two requests' tokens (each program walks its own
request from its first token); slots past the request's end load k = v = beta = g = 0,
which writes nothing and decays nothing, so G_C is the decay to the request's last
token and the stored state is the state after it.

Layout (asserted by the launcher): q, k [T, H, K] and v [T, H, V] with unit last
stride; g, beta [T, H] (any strides); cu_seqlens [B+1] contiguous integers;
state [B, H, K, V] contiguous float32, read as each request's initial state (zero
for a fresh one) and overwritten with its final state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ._triton import check_kernel_dtype, launcher, next_power_of_2, require_triton, tl, triton

if TYPE_CHECKING:
    from triton.runtime.jit import KernelInterface

CHUNK = 64  # tokens per chunk on the GPU (a power of two, 16 at least: tl.dot's minimum)
MAX_BLOCK_V = 64  # value columns per program: the state block [K, BLOCK_V] stays in registers

if triton is not None:

    @triton.jit
    def unit_lower_inverse(strictly_lower, CHUNK: tl.constexpr):
        """(I + A)^-1 for strictly lower-triangular A [CHUNK, CHUNK], by forward
        substitution: row i of the inverse is e_i - sum_{s<i} A[i, s] (row s)."""
        rows = tl.arange(0, CHUNK)
        inverse = (rows[:, None] == rows[None, :]).to(tl.float32)
        for i in range(1, CHUNK):
            a_row = tl.sum(tl.where(rows[:, None] == i, strictly_lower, 0.0), axis=0)  # A[i, :]
            # tl.sum's result is typed as possibly a tl.tuple, whose indices are constexprs
            combined = tl.sum(a_row[:, None] * inverse, axis=0)  # pyright: ignore[reportArgumentType]
            inverse = tl.where(rows[:, None] == i, inverse - combined[None, :], inverse)  # pyright: ignore[reportArgumentType]
        return inverse

    @triton.jit
    def state_block(request, head, key_cols, value_cols, NUM_HEADS: tl.constexpr, KEY_DIM: tl.constexpr,
                    VALUE_DIM: tl.constexpr):
        """(offsets, mask) [K_P, BLOCK_V] of a program's block of the contiguous state
        [B, H, K, V]: its request and head, rows ``key_cols``, columns ``value_cols``."""
        offsets = ((request * NUM_HEADS + head).to(tl.int64) * KEY_DIM * VALUE_DIM
                   + key_cols[:, None] * VALUE_DIM + value_cols[None, :])
        return offsets, (key_cols < KEY_DIM)[:, None] & (value_cols < VALUE_DIM)[None, :]

    @triton.jit
    def load_rows(ptr, tokens, stride_tok, head, stride_head, cols, mask):
        """x[tokens, head, cols] [C, len(cols)] of a [T, H, D] tensor with unit last stride,
        in float32, zero where ``mask`` is not set."""
        return tl.load(ptr + tokens[:, None] * stride_tok + head * stride_head + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)

    @triton.jit
    def delta_rule_chunk_update(state, q_decayed, k_to_end, attn, inverse, beta_k_decayed, beta_v, chunk_decay):
        """One chunk's outputs [C, BV] and the state after it (the module docstring's
        last three lines); the decays are already folded into the arguments."""
        w = tl.dot(inverse, beta_k_decayed, input_precision="ieee")  # [C, K]
        u = tl.dot(inverse, beta_v, input_precision="ieee") - tl.dot(w, state, input_precision="ieee")  # [C, BV]
        out = tl.dot(q_decayed, state, input_precision="ieee") + tl.dot(attn, u, input_precision="ieee")
        state = state * chunk_decay + tl.dot(tl.trans(k_to_end), u, input_precision="ieee")
        return out, state

    @triton.jit
    def _gated_delta_rule_kernel(
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
        causal = rows[None, :] <= rows[:, None]  # [t, s]: s <= t
        strictly_causal = rows[None, :] < rows[:, None]

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
            v = load_rows(v_ptr, tokens, stride_v_tok, head, stride_v_head, value_cols, value_mask)
            g = tl.load(g_ptr + tokens * stride_g_tok + head * stride_g_head, mask=token_ok, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + tokens * stride_beta_tok + head * stride_beta_head, mask=token_ok,
                           other=0.0).to(tl.float32)

            cum = tl.cumsum(g, axis=0)  # [C]
            cum_end = tl.sum(g, axis=0)
            # e^(G_t - G_s) for s <= t; the exponent is masked first, since above the
            # diagonal it is positive and could overflow.
            decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
            key_products = tl.dot(k, tl.trans(k), input_precision="ieee")  # [C, C]
            inverse = unit_lower_inverse(tl.where(strictly_causal, beta[:, None] * key_products * decay, 0.0), CHUNK)
            attn = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
            growth = tl.exp(cum)[:, None]
            out, state = delta_rule_chunk_update(
                state, q * growth, k * tl.exp(cum_end - cum)[:, None], attn, inverse,
                beta[:, None] * k * growth, beta[:, None] * v, tl.exp(cum_end))
            tl.store(out_ptr + tokens[:, None] * stride_o_tok + head * stride_o_head + value_cols[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=value_mask)
        tl.store(state_ptr + state_offs, state, mask=state_mask)


def check_packed_layout(query, key, value, g, beta, cu_seqlens, state, g_per_key: bool) -> None:
    """The layout the delta-rule kernels read (module docstring); g is [T, H] or, per
    key channel, [T, H, K]."""
    num_tokens, num_heads, key_dim = query.shape
    value_dim = value.shape[2]
    assert key.shape == query.shape and value.shape[:2] == (num_tokens, num_heads), (
        f"q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}: heads must match"
    )
    assert query.stride(2) == 1 and key.stride(2) == 1 and value.stride(2) == 1, "q, k, v need a unit last stride"
    g_shape = (num_tokens, num_heads, key_dim) if g_per_key else (num_tokens, num_heads)
    assert g.shape == g_shape and beta.shape == (num_tokens, num_heads), (
        f"g {tuple(g.shape)} (expected {g_shape}), beta {tuple(beta.shape)}"
    )
    assert not g_per_key or g.stride(2) == 1, "a per-key-channel g needs a unit last stride"
    for name, t in (("q", query), ("k", key), ("v", value), ("g", g), ("beta", beta)):
        check_kernel_dtype(name, t)
    num_requests = cu_seqlens.shape[0] - 1
    assert cu_seqlens.dtype in (torch.int32, torch.int64) and cu_seqlens.is_contiguous(), (
        f"cu_seqlens must be contiguous int32 or int64, got {cu_seqlens.dtype}"
    )
    assert state.shape == (num_requests, num_heads, key_dim, value_dim) and state.is_contiguous(), (
        f"state must be contiguous [{num_requests}, {num_heads}, {key_dim}, {value_dim}], got {tuple(state.shape)}"
    )
    assert state.dtype == torch.float32, f"state must be float32, got {state.dtype}"
    devices = {t.device for t in (query, key, value, g, beta, cu_seqlens, state)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"


def kernel_chunk(max_length: int, chunk: int) -> int:
    """The chunk a step takes: ``chunk`` (a power of two, 16 at least), or less for a
    step of short requests (down to tl.dot's minimum of 16)."""
    assert chunk >= 16 and chunk & (chunk - 1) == 0, f"chunk must be a power of two >= 16, got {chunk}"
    return max(16, min(chunk, next_power_of_2(max_length)))


def chunk_gated_delta_rule_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor,
                                  chunk: int = CHUNK, block_v: int = MAX_BLOCK_V) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as shardline.engine.recurrent.delta_rule.chunk_gated_delta_rule_varlen:
    query, key [T, H, K]; value [T, H, V]; g (log decay), beta [T, H]; state [B, H, K, V]
    float32, each request's initial state, overwritten with its final state. Returns
    (output [T, H, V] in value's dtype, state). ``chunk`` and ``block_v`` (powers of two,
    16 at least) are the most tokens per chunk and value columns per program."""
    require_triton()
    check_packed_layout(query, key, value, g, beta, cu_seqlens, state, g_per_key=False)
    return launch_chunked_rule(_gated_delta_rule_kernel, query, key, value, g, beta, cu_seqlens, state, chunk, block_v)


def launch_chunked_rule(kernel: KernelInterface[Any], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor, chunk: int,
                        block_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch a chunked delta-rule kernel (this module's or kernels/kda.py's: both take the
    same arguments) over a layout check_packed_layout has passed: one program per request,
    head and block of value columns. Returns (output [T, H, V] in value's dtype, state)."""
    num_tokens, num_heads, key_dim = query.shape
    value_dim = value.shape[2]
    num_requests = cu_seqlens.shape[0] - 1
    out = torch.empty((num_tokens, num_heads, value_dim), dtype=value.dtype, device=value.device)
    if num_tokens == 0 or num_requests == 0:
        return out, state
    max_length = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    block_v = max(16, min(block_v, next_power_of_2(value_dim)))
    grid = (num_requests, num_heads, triton.cdiv(value_dim, block_v))
    launcher(kernel, grid)(
        query, key, value, g, beta, out, cu_seqlens, state,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, KEY_DIM=key_dim, VALUE_DIM=value_dim,
        KEY_P=max(16, next_power_of_2(key_dim)), BLOCK_V=block_v, CHUNK=kernel_chunk(max_length, chunk),
    )
    return out, state
