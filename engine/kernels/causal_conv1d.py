"""Depthwise causal convolution over a packed batch of requests (Triton), each
request continuing its own convolution window.

Layout (asserted by the launcher): x [T, D] contiguous, the packed inputs of B
requests (request b's tokens are x[cu_seqlens[b]:cu_seqlens[b+1]]); weight [D, W]
contiguous; conv_state [B, W-1, D] contiguous, request b's last W-1 inputs before
this step, read where has_initial_state[b] (zero otherwise). The output at a token at
position p of its request is sum_j weight[:, j] * input[p - (W-1) + j], the input
before position 0 coming from the state. The kernel only reads the state; the caller
writes the new windows (engine/recurrent/conv_varlen.py). The plain-torch reference is
recurrent_reference.causal_conv1d_reference, run per request.
"""

from __future__ import annotations

import torch

from ._triton import check_kernel_dtype, launcher, require_triton, tl, triton

BLOCK_T = 16
BLOCK_D = 64

if triton is not None:

    @triton.jit
    def _causal_conv1d_varlen_kernel(
        x_ptr, weight_ptr, bias_ptr, state_ptr, out_ptr,
        token_request_ptr, token_position_ptr, request_start_ptr, has_initial_ptr,
        num_tokens, channels,
        WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # One program per (block of tokens, block of channels); each tap reads the
        # input W-1-j tokens back, from x or, before the request's step, its state.
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        token_mask = tokens < num_tokens
        dim_mask = dims < channels
        mask = token_mask[:, None] & dim_mask[None, :]
        request = tl.load(token_request_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
        position = tl.load(token_position_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
        start = tl.load(request_start_ptr + request, mask=token_mask, other=0).to(tl.int64)
        has_initial = tl.load(has_initial_ptr + request, mask=token_mask, other=0) != 0
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        # Triton unrolls tl.static_range when it compiles the kernel; as a Python object it
        # only raises on iteration, so the checker sees no iterator.
        for tap in tl.static_range(WIDTH):  # pyright: ignore[reportGeneralTypeIssues]
            source = position - (WIDTH - 1) + tap  # position of the tap's input in the request
            from_x = source >= 0
            x_offs = (start + source)[:, None] * channels + dims[None, :]
            x_val = tl.load(x_ptr + x_offs, mask=mask & from_x[:, None], other=0.0).to(tl.float32)
            state_row = request * (WIDTH - 1) + (WIDTH - 1) + source
            s_offs = state_row[:, None] * channels + dims[None, :]
            s_mask = mask & ((~from_x) & has_initial)[:, None]
            s_val = tl.load(state_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + dims * WIDTH + tap, mask=dim_mask, other=0.0).to(tl.float32)
            acc += (x_val + s_val) * w[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + tokens[:, None] * channels + dims[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_varlen_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor, conv_state: torch.Tensor,
                                activation: str | None) -> torch.Tensor:
    """The convolution's outputs [T, D] (see the module docstring); conv_state is read only."""
    require_triton()
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_requests = cu_seqlens.shape[0] - 1
    check_kernel_dtype("x", x)
    assert activation in (None, "silu"), activation
    assert x.is_contiguous() and weight.is_contiguous() and conv_state.is_contiguous()
    assert weight.shape == (channels, width) and conv_state.shape == (num_requests, width - 1, channels)
    assert bias is None or (bias.shape == (channels,) and bias.is_contiguous())
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    token_request = torch.repeat_interleave(torch.arange(num_requests, device=x.device), lengths,
                                            output_size=num_tokens).to(torch.int32)
    token_position = (torch.arange(num_tokens, device=x.device) - cu_seqlens[:-1][token_request]).to(torch.int32)
    out = torch.empty_like(x)
    grid = (triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(channels, BLOCK_D))
    launcher(_causal_conv1d_varlen_kernel, grid)(
        x, weight, bias if bias is not None else weight, conv_state, out,
        token_request, token_position, cu_seqlens[:-1].to(torch.int32).contiguous(),
        has_initial_state.to(torch.int8).contiguous(), num_tokens, channels,
        WIDTH=width, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
    )
    return out
