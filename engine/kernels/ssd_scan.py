"""Mamba-2's chunked SSD scan over a packed batch, as one Triton kernel (CUDA); lightning
attention runs through it too (dt = 1, x = v, B = k, C = q, one group per head).

One program runs one request's tokens for one head and a block of its channels, a
chunk of CHUNK tokens at a time, keeping its block of the state S [BLOCK_P, N] in
registers (float32). With a_t = dt_t A_h and G_t the chunk's cumulative sum of a up to
token t (the algebra of shardline.engine.recurrent.ssd, its plain-torch reference):
    y = causal(e^(G_t - G_s) C_t.B_s) (dt x) + e^G (C S^T) + D x
    S <- e^(G_C) S + (e^(G_C - G) dt x)^T B
Every product runs in float32 (IEEE, never TF32), as Hugging Face's Mamba-2 scan runs.

Invariants: a chunk never holds two requests' tokens; slots past the request's end
load dt = 0 and x = 0 (decay 1, no input), so the stored state is the state after the
request's last token.

Layout (asserted by the launcher): x [T, H, P] with unit last stride; dt [T, H];
A [H] float32; B, C [T, G, N] with unit last stride and H a multiple of G (head h
reads group h // (H / G)); D [H] or None; cu_seqlens [B+1] contiguous integers; the
state [B, H, P, N] contiguous float32.
"""

from __future__ import annotations

import torch

from ._triton import check_kernel_dtype, launcher, next_power_of_2, require_triton, tl, triton
from .delta_rule import kernel_chunk

CHUNK = 64  # tokens per chunk on the GPU (a power of two, 16 at least: tl.dot's minimum)
MAX_BLOCK_P = 32  # channels per program: the state block [BLOCK_P, N] stays in registers

if triton is not None:

    @triton.jit
    def _ssd_scan_kernel(
        x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, cu_ptr, state_ptr,
        stride_x_tok, stride_x_head, stride_dt_tok, stride_dt_head,
        stride_b_tok, stride_b_grp, stride_c_tok, stride_c_grp, stride_y_tok, stride_y_head,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, STATE: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
        STATE_P: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr, HAS_D: tl.constexpr,
    ):
        request = tl.program_id(0)
        head = tl.program_id(1)
        group = head // HEADS_PER_GROUP
        channels = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        states = tl.arange(0, STATE_P)
        channel_ok = channels < HEAD_DIM
        state_ok = states < STATE
        rows = tl.arange(0, CHUNK)
        causal = rows[None, :] <= rows[:, None]  # [t, s]: s <= t

        state_offs = ((request * NUM_HEADS + head).to(tl.int64) * HEAD_DIM * STATE
                      + channels[:, None] * STATE + states[None, :])
        state_mask = channel_ok[:, None] & state_ok[None, :]
        state = tl.load(state_ptr + state_offs, mask=state_mask, other=0.0)
        A = tl.load(A_ptr + head)
        if HAS_D:
            skip = tl.load(D_ptr + head).to(tl.float32)

        start = tl.load(cu_ptr + request).to(tl.int64)
        end = tl.load(cu_ptr + request + 1).to(tl.int64)
        for chunk_start in range(start, end, CHUNK):
            tokens = chunk_start + rows
            token_ok = tokens < end
            x_mask = token_ok[:, None] & channel_ok[None, :]
            bc_mask = token_ok[:, None] & state_ok[None, :]
            x = tl.load(x_ptr + tokens[:, None] * stride_x_tok + head * stride_x_head + channels[None, :],
                        mask=x_mask, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + tokens * stride_dt_tok + head * stride_dt_head, mask=token_ok,
                         other=0.0).to(tl.float32)
            B = tl.load(B_ptr + tokens[:, None] * stride_b_tok + group * stride_b_grp + states[None, :],
                        mask=bc_mask, other=0.0).to(tl.float32)
            C = tl.load(C_ptr + tokens[:, None] * stride_c_tok + group * stride_c_grp + states[None, :],
                        mask=bc_mask, other=0.0).to(tl.float32)

            log_decay = dt * A
            cum = tl.cumsum(log_decay, axis=0)  # [Q]
            cum_end = tl.sum(log_decay, axis=0)
            # The exponent is masked first: above the diagonal it is positive and could overflow.
            decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
            scores = tl.dot(C, tl.trans(B), input_precision="ieee") * decay  # [Q, Q]
            x_dt = x * dt[:, None]
            y = (tl.dot(scores, x_dt, input_precision="ieee")
                 + tl.exp(cum)[:, None] * tl.dot(C, tl.trans(state), input_precision="ieee"))
            if HAS_D:
                y += skip * x
            state = (state * tl.exp(cum_end)
                     + tl.dot(tl.trans(x_dt * tl.exp(cum_end - cum)[:, None]), B, input_precision="ieee"))
            tl.store(y_ptr + tokens[:, None] * stride_y_tok + head * stride_y_head + channels[None, :],
                     y.to(y_ptr.dtype.element_ty), mask=x_mask)
        tl.store(state_ptr + state_offs, state, mask=state_mask)


def _check_layout(x, dt, A, B, C, D, cu_seqlens, initial_state) -> None:
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(2) == 1, "x needs a unit last stride"
    assert dt.shape == (num_tokens, num_heads), f"dt must be [{num_tokens}, {num_heads}], got {tuple(dt.shape)}"
    assert A.shape == (num_heads,) and A.dtype == torch.float32, f"A must be float32 [{num_heads}]"
    assert B.shape == C.shape and B.dim() == 3 and B.shape[0] == num_tokens, (
        f"B, C must be [T={num_tokens}, G, N], got {tuple(B.shape)}, {tuple(C.shape)}"
    )
    assert B.stride(2) == 1 and C.stride(2) == 1, "B and C need a unit last stride"
    assert num_heads % B.shape[1] == 0, f"{num_heads} heads do not split into {B.shape[1]} groups"
    assert D is None or (D.shape == (num_heads,) and D.is_contiguous()), f"D must be contiguous [{num_heads}]"
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C)):
        check_kernel_dtype(name, t)
    num_requests = cu_seqlens.shape[0] - 1
    assert cu_seqlens.dtype in (torch.int32, torch.int64) and cu_seqlens.is_contiguous(), (
        f"cu_seqlens must be contiguous int32 or int64, got {cu_seqlens.dtype}"
    )
    assert initial_state.shape == (num_requests, num_heads, head_dim, B.shape[2]), (
        f"initial_state must be [{num_requests}, {num_heads}, {head_dim}, {B.shape[2]}], "
        f"got {tuple(initial_state.shape)}"
    )
    devices = {t.device for t in (x, dt, A, B, C, cu_seqlens, initial_state)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"


def ssd_chunk_scan_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor,
    chunk: int = CHUNK,
    block_p: int = MAX_BLOCK_P,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as shardline.engine.recurrent.ssd.ssd_chunk_scan_varlen in float32:
    x [T, H, P]; dt [T, H] (biased, softplus'd, clamped); A [H]; B, C [T, G, N]; D [H]
    or None; initial_state [B, H, P, N] (zero for a fresh request), left unchanged.
    Returns (y [T, H, P] float32, the final states [B, H, P, N] float32). ``chunk`` and
    ``block_p`` (powers of two, 16 at least) are the most tokens per chunk and channels
    per program."""
    require_triton()
    A = A.float().contiguous()
    _check_layout(x, dt, A, B, C, D, cu_seqlens, initial_state)
    num_tokens, num_heads, head_dim = x.shape
    state_size = B.shape[2]
    num_requests = cu_seqlens.shape[0] - 1
    state = initial_state.to(torch.float32, copy=True).contiguous()
    y = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_requests == 0:
        return y, state
    max_length = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    block_p = max(16, min(block_p, next_power_of_2(head_dim)))
    grid = (num_requests, num_heads, triton.cdiv(head_dim, block_p))
    launcher(_ssd_scan_kernel, grid)(
        x, dt, A, B, C, D if D is not None else A, y, cu_seqlens, state,
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1), y.stride(0), y.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, STATE=state_size, HEADS_PER_GROUP=num_heads // B.shape[1],
        STATE_P=max(16, next_power_of_2(state_size)), BLOCK_P=block_p, CHUNK=kernel_chunk(max_length, chunk),
        HAS_D=D is not None,
    )
    return y, state
