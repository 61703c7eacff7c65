"""Mamba-1's selective scan over a packed batch, as one Triton kernel (CUDA).

One program runs one request's tokens for a block of channels, in order, keeping the
block's state [BLOCK_D, N] in registers (float32):
    h = exp(dt * A) * h + dt * B_t x_t;   y_t = (h . C_t + D x_t) * silu(z_t)
It serves a fresh prompt, a chunk that continues a saved state, and a single decode
token alike. The plain-torch reference is shardline.engine.recurrent.selective_scan
(selective_scan_varlen, and selective_state_update for one token).

Layout (asserted by the launcher): x, dt, z [T, Dc] and y [T, Dc] with unit channel
stride; A [Dc, N] contiguous float32; B, C [T, G, N] with unit state stride;
D [Dc]; cu_seqlens [Bq+1] int64; state [Bq, Dc, N] contiguous float32, read where
has_initial_state and overwritten with each request's final state.
"""

from __future__ import annotations

import torch

from ._triton import check_kernel_dtype, launcher, next_power_of_2, require_triton, tl, triton

if triton is not None:

    @triton.jit
    def _selective_scan_kernel(
        x_ptr, dt_ptr, z_ptr, y_ptr, A_ptr, B_ptr, C_ptr, D_ptr, cu_ptr, has_state_ptr, state_ptr,
        stride_x, stride_dt, stride_z, stride_y, stride_b_tok, stride_b_grp, stride_c_tok, stride_c_grp,
        CHANNELS: tl.constexpr, STATE: tl.constexpr, PER_GROUP: tl.constexpr,
        BLOCK_D: tl.constexpr, STATE_P: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    ):
        request = tl.program_id(0)
        channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        states = tl.arange(0, STATE_P)
        channel_ok = channels < CHANNELS
        tile_ok = channel_ok[:, None] & (states < STATE)[None, :]
        groups = channels // PER_GROUP

        tile = channels[:, None] * STATE + states[None, :]
        A = tl.load(A_ptr + tile, mask=tile_ok, other=0.0)
        state_offs = request.to(tl.int64) * CHANNELS * STATE + tile
        h = tl.zeros((BLOCK_D, STATE_P), dtype=tl.float32)
        if tl.load(has_state_ptr + request) != 0:
            h = tl.load(state_ptr + state_offs, mask=tile_ok, other=0.0)
        if HAS_D:
            skip = tl.load(D_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)

        start = tl.load(cu_ptr + request)
        end = tl.load(cu_ptr + request + 1)
        for token in range(start, end):
            x = tl.load(x_ptr + token * stride_x + channels, mask=channel_ok, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + token * stride_dt + channels, mask=channel_ok, other=0.0).to(tl.float32)
            bc_offs = groups[:, None] * stride_b_grp + states[None, :]
            B = tl.load(B_ptr + token * stride_b_tok + bc_offs, mask=tile_ok, other=0.0).to(tl.float32)
            cc_offs = groups[:, None] * stride_c_grp + states[None, :]
            C = tl.load(C_ptr + token * stride_c_tok + cc_offs, mask=tile_ok, other=0.0).to(tl.float32)
            h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * B
            y = tl.sum(h * C, axis=1)
            if HAS_D:
                y += skip * x
            if HAS_Z:
                z = tl.load(z_ptr + token * stride_z + channels, mask=channel_ok, other=0.0).to(tl.float32)
                y = y * z * tl.sigmoid(z)
            tl.store(y_ptr + token * stride_y + channels, y.to(y_ptr.dtype.element_ty), mask=channel_ok)
        tl.store(state_ptr + state_offs, h, mask=tile_ok)


def _check_layout(x, dt, A, B, C, D, z, cu_seqlens, has_initial_state, state) -> None:
    num_tokens, channels = x.shape
    assert dt.shape == x.shape and (z is None or z.shape == x.shape), (
        f"x {tuple(x.shape)}, dt {tuple(dt.shape)}, z {None if z is None else tuple(z.shape)}"
    )
    assert x.stride(1) == 1 and dt.stride(1) == 1 and (z is None or z.stride(1) == 1), "channels must be contiguous"
    assert A.dim() == 2 and A.shape[0] == channels and A.is_contiguous() and A.dtype == torch.float32, (
        f"A must be contiguous float32 [Dc={channels}, N], got {A.dtype} {tuple(A.shape)}"
    )
    state_size = A.shape[1]
    for name, t in (("B", B), ("C", C)):
        assert t.dim() == 3 and t.shape[0] == num_tokens and t.shape[2] == state_size and t.stride(2) == 1, (
            f"{name} must be [T={num_tokens}, G, N={state_size}] with unit state stride, got {tuple(t.shape)}"
        )
        assert channels % t.shape[1] == 0, f"{channels} channels do not split into {t.shape[1]} groups"
    assert D is None or (D.shape == (channels,) and D.is_contiguous()), "D must be contiguous [Dc]"
    num_requests = cu_seqlens.shape[0] - 1
    assert cu_seqlens.dtype == torch.int64 and cu_seqlens.is_contiguous(), "cu_seqlens must be contiguous int64"
    assert has_initial_state.shape == (num_requests,), f"has_initial_state must be [{num_requests}]"
    assert state.shape == (num_requests, channels, state_size) and state.is_contiguous(), (
        f"state must be contiguous [{num_requests}, {channels}, {state_size}], got {tuple(state.shape)}"
    )
    assert state.dtype == torch.float32, f"state must be float32, got {state.dtype}"
    devices = {t.device for t in (x, dt, A, B, C, cu_seqlens, has_initial_state, state)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"


def selective_scan_packed(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    state: torch.Tensor,
    block_d: int = 32,
) -> torch.Tensor:
    """Scan every request of the packed batch from its state (zero where not
    has_initial_state); ``state`` is left holding the final states. x, dt (softplus'd),
    z: [T, Dc]; A: [Dc, N] float32; B, C: [T, G, N]. Returns y [T, Dc] in x's dtype."""
    require_triton()
    check_kernel_dtype("x", x)
    _check_layout(x, dt, A, B, C, D, z, cu_seqlens, has_initial_state, state)
    num_tokens, channels = x.shape
    y = torch.empty_like(x)
    num_requests = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_requests == 0:
        return y
    has_state = has_initial_state.to(torch.int32).contiguous()
    grid = (num_requests, triton.cdiv(channels, block_d))
    launcher(_selective_scan_kernel, grid)(
        x, dt, z if z is not None else x, y, A, B, C, D if D is not None else x, cu_seqlens, has_state, state,
        x.stride(0), dt.stride(0), z.stride(0) if z is not None else 0, y.stride(0),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        CHANNELS=channels, STATE=A.shape[1], PER_GROUP=channels // B.shape[1],
        BLOCK_D=block_d, STATE_P=next_power_of_2(A.shape[1]), HAS_D=D is not None, HAS_Z=z is not None,
    )
    return y


def ssd_decode_packed(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
) -> torch.Tensor:
    """Mamba-2's single-token update through the same kernel: a head's decay, dt and D
    are its channels' (head h owns channels h*P .. h*P+P-1), and B, C's groups cover
    whole heads. Same contract as shardline.engine.recurrent.ssd.ssd_decode_step:
    state [Bq, H, P, N] float32 updated in place; x [Bq, H, P]; dt [Bq, H]; A, D [H];
    B, C [Bq, G, N]. Returns y [Bq, H, P]."""
    num_requests, num_heads, head_dim = x.shape
    channels = num_heads * head_dim
    state_size = state.shape[-1]
    assert state.is_contiguous(), "state must be contiguous"
    per_channel_dt = dt[:, :, None].expand(num_requests, num_heads, head_dim).reshape(num_requests, channels)
    per_channel_A = A.float()[:, None, None].expand(num_heads, head_dim, state_size).reshape(channels, state_size)
    per_channel_D = None if D is None else D[:, None].expand(num_heads, head_dim).reshape(channels)
    one_token_each = torch.arange(num_requests + 1, device=x.device)
    continuing = torch.ones(num_requests, dtype=torch.bool, device=x.device)
    y = selective_scan_packed(
        x.reshape(num_requests, channels), per_channel_dt.contiguous(), per_channel_A.contiguous(), B, C,
        per_channel_D, None, one_token_each, continuing, state.view(num_requests, channels, state_size),
    )
    return y.view(num_requests, num_heads, head_dim)
