"""RWKV-4's WKV recurrence over a packed batch as one Triton kernel (CUDA): prefill
chunks and decode tokens alike.

One program runs one request's tokens in order for BLOCK channels, its numerator,
denominator and running maximum held in registers (float32) and written back after
the request's last token; the arithmetic is rwkv_wkv.py's ``wkv_step``, which with
``wkv_varlen`` is the plain-torch reference the tests compare this kernel with.

Layout (asserted by the launcher): key, value [T, A] with unit last stride (key any
kernel dtype, read as float32; value's dtype is the output's); decay = -exp(time_decay)
and first [A] contiguous float32; cu_seqlens [B+1] int64; has_initial_state [B] bool;
num, den, maximum [B, A] contiguous float32, updated in place.
"""

from __future__ import annotations

import torch

from ._triton import check_kernel_dtype, launcher, next_power_of_2, require_triton, tl, triton
from .rwkv_wkv import FRESH_MAX

MAX_BLOCK = 128  # channels per program

if triton is not None:

    @triton.jit
    def _wkv_varlen_kernel(
        key_ptr, value_ptr, out_ptr, decay_ptr, first_ptr, cu_ptr, has_state_ptr, num_ptr, den_ptr, max_ptr,
        stride_key, stride_value, stride_out, WIDTH: tl.constexpr, BLOCK: tl.constexpr, FRESH: tl.constexpr,
    ):
        request = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < WIDTH
        start = tl.load(cu_ptr + request)
        end = tl.load(cu_ptr + request + 1)
        keep = tl.load(has_state_ptr + request) != 0
        state_offs = request * WIDTH + cols
        a = tl.where(keep, tl.load(num_ptr + state_offs, mask=ok, other=0.0), 0.0)
        b = tl.where(keep, tl.load(den_ptr + state_offs, mask=ok, other=0.0), 0.0)
        p = tl.where(keep, tl.load(max_ptr + state_offs, mask=ok, other=0.0), FRESH)
        decay = tl.load(decay_ptr + cols, mask=ok, other=0.0)
        first = tl.load(first_ptr + cols, mask=ok, other=0.0)
        for token in range(start, end):
            k = tl.load(key_ptr + token * stride_key + cols, mask=ok, other=0.0).to(tl.float32)
            v = tl.load(value_ptr + token * stride_value + cols, mask=ok, other=0.0).to(tl.float32)
            output_max = tl.maximum(p, k + first)
            scale_state = tl.exp(p - output_max)
            scale_token = tl.exp(k + first - output_max)
            out = (scale_state * a + scale_token * v) / (scale_state * b + scale_token)
            tl.store(out_ptr + token * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)
            state_max = tl.maximum(p + decay, k)
            scale_state = tl.exp(p + decay - state_max)
            scale_token = tl.exp(k - state_max)
            a = scale_state * a + scale_token * v
            b = scale_state * b + scale_token
            p = state_max
        tl.store(num_ptr + state_offs, a, mask=ok)
        tl.store(den_ptr + state_offs, b, mask=ok)
        tl.store(max_ptr + state_offs, p, mask=ok)


def _check_layout(key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, first: torch.Tensor,
                  cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor, states: tuple[torch.Tensor, ...]) -> None:
    num_tokens, width = key.shape
    assert value.shape == (num_tokens, width), f"value {tuple(value.shape)} is not key's {tuple(key.shape)}"
    assert key.stride(1) == 1 and value.stride(1) == 1, "key and value need a unit last stride"
    check_kernel_dtype("key", key)
    check_kernel_dtype("value", value)
    for name, tensor in (("decay", decay), ("first", first)):
        assert tensor.shape == (width,) and tensor.is_contiguous() and tensor.dtype == torch.float32, \
            f"{name} must be [{width}] contiguous float32, got {tuple(tensor.shape)} {tensor.dtype}"
    num_requests = cu_seqlens.shape[0] - 1
    assert cu_seqlens.dtype == torch.int64 and has_initial_state.shape == (num_requests,), "bad cu_seqlens"
    for state in states:
        assert state.shape == (num_requests, width) and state.is_contiguous() and state.dtype == torch.float32, \
            f"a WKV state must be [{num_requests}, {width}] contiguous float32, got {tuple(state.shape)} {state.dtype}"


def wkv_varlen_triton(decay: torch.Tensor, first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor, num: torch.Tensor, den: torch.Tensor,
                      maximum: torch.Tensor, block: int = MAX_BLOCK) -> torch.Tensor:
    """The WKV output [T, A] (value's dtype) of a packed batch, as rwkv_wkv.wkv_varlen
    computes it (``decay`` is already -exp(time_decay)); the states are read where
    has_initial_state and updated in place."""
    require_triton()
    _check_layout(key, value, decay, first, cu_seqlens, has_initial_state, (num, den, maximum))
    num_requests, width = cu_seqlens.shape[0] - 1, key.shape[1]
    out = torch.empty_like(value)
    if num_requests == 0 or key.shape[0] == 0:
        return out
    block = min(block, next_power_of_2(width))
    launcher(_wkv_varlen_kernel, (num_requests, triton.cdiv(width, block)))(
        key, value, out, decay, first, cu_seqlens, has_initial_state, num, den, maximum,
        key.stride(0), value.stride(0), out.stride(0), WIDTH=width, BLOCK=block, FRESH=FRESH_MAX,
    )
    return out
