"""Depthwise causal convolution over a packed batch of requests, each continuing
its own convolution window (the short convolutions of LFM2 and of gated delta-net
layers).

A request's state is its last ``W - 1`` inputs (W: the kernel width), so the output
at a token reads the W - 1 inputs before it, from the state where they precede the
step. ``causal_conv1d_varlen`` lays every request's state rows before its tokens in
one sequence and sums its W shifted copies, each times its tap: no output reads
across a request boundary, since each reads exactly its own W - 1 predecessors.
On CUDA a Triton kernel computes the outputs of steps with prefill chunks
(engine/kernels/causal_conv1d.py, tested against engine/kernels/recurrent_reference.py's
``causal_conv1d_reference``); on the
CPU, where the engine takes the recurrent kernel, a C kernel the whole convolution
(engine/kernels/cpu_recurrent.py).
"""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN

from ..kernels._triton import KERNEL_DTYPES, triton_available
from ..kernels.causal_conv1d import causal_conv1d_varlen_triton
from ..kernels.cpu_recurrent import causal_conv1d, conv_kernel_available


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                         has_initial_state: torch.Tensor, conv_state: torch.Tensor,
                         activation: str | None = None, native: bool = False) -> torch.Tensor:
    """x: [T, D] packed inputs; weight: [D, W]; conv_state: [B, W-1, D], read where
    has_initial_state and overwritten with each request's last W-1 inputs.
    ``native``: through the CPU kernel (kernels/cpu_recurrent.py) where it takes the
    tensors (the layer's kind says, as the engine's CPU paths chose). Returns [T, D]."""
    if native and _takes_native(x, weight, bias, conv_state, activation):
        return causal_conv1d(x if x.stride(1) == 1 else x.contiguous(), weight, bias, cu_seqlens, has_initial_state,
                             conv_state, activation)
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_requests = cu_seqlens.shape[0] - 1
    assert conv_state.shape == (num_requests, width - 1, channels), (conv_state.shape, width, channels)
    history = width - 1
    device = x.device
    if num_tokens == num_requests:  # one token per request: a decode step
        return _conv_step(x, weight, bias, has_initial_state, conv_state, activation)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    request_of_token = torch.repeat_interleave(torch.arange(num_requests, device=device), lengths,
                                               output_size=num_tokens)
    # Request b's segment of the laid-out sequence: its W-1 state rows, then its tokens.
    segment_start = cu_seqlens[:-1] + torch.arange(num_requests, device=device) * history
    token_rows = torch.arange(num_tokens, device=device) + (request_of_token + 1) * history
    state_rows = (segment_start[:, None] + torch.arange(history, device=device)).flatten()
    initial = conv_state.to(x.dtype) * has_initial_state.to(x.dtype)[:, None, None]
    sequence = x.new_empty((num_tokens + num_requests * history, channels))
    sequence[token_rows] = x
    sequence[state_rows] = initial.reshape(-1, channels)
    if _takes_triton(x, weight, activation):  # reads the state before it is overwritten below
        out = causal_conv1d_varlen_triton(x.contiguous(), weight.contiguous(), bias, cu_seqlens, has_initial_state,
                                          conv_state, activation)
        _write_windows(conv_state, sequence, segment_start + lengths + history, history)
        return out
    # out[p] = sum_j weight[:, j] * sequence[p + j] (p: the output's first input row)
    laid_out = sequence.to(weight.dtype)
    length = laid_out.shape[0] - history
    out = laid_out[:length] * weight[:, 0]
    for tap in range(1, width):
        out.addcmul_(laid_out[tap : tap + length], weight[:, tap])
    if bias is not None:
        out = out + bias
    if activation is not None:
        out = ACT2FN[activation](out)
    _write_windows(conv_state, sequence, segment_start + lengths + history, history)
    return out[token_rows - history].to(x.dtype)


def _write_windows(conv_state: torch.Tensor, sequence: torch.Tensor, segment_end: torch.Tensor, history: int) -> None:
    """Each request's last W-1 rows (inputs) of the laid-out sequence are its next state."""
    conv_state.copy_(sequence[segment_end[:, None] - history + torch.arange(history, device=sequence.device)])


def _takes_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  activation: str | None) -> bool:
    """The CPU kernel runs one dtype (float32 or float64) throughout, SiLU or no activation."""
    return (x.device.type == "cpu" and not x.requires_grad and activation in (None, "silu")
            and x.dtype == weight.dtype == conv_state.dtype and (bias is None or bias.dtype == x.dtype)
            and conv_state.is_contiguous() and conv_kernel_available(x.dtype))


def _takes_triton(x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> bool:
    """On CUDA the Triton kernel computes the outputs (engine/kernels/causal_conv1d.py)."""
    return (x.is_cuda and triton_available() and x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype
            and activation in (None, "silu"))


def _conv_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, has_initial_state: torch.Tensor,
               conv_state: torch.Tensor, activation: str | None) -> torch.Tensor:
    """One token per request: x [B, D]; conv_state [B, W-1, D] updated in place."""
    initial = conv_state.to(x.dtype) * has_initial_state.to(x.dtype)[:, None, None]
    window = torch.cat([initial, x[:, None]], dim=1)  # [B, W, D], oldest first
    out = (window.to(weight.dtype) * weight.t()).sum(1)
    if bias is not None:
        out = out + bias
    if activation is not None:
        out = ACT2FN[activation](out)
    conv_state.copy_(window[:, 1:])
    return out.to(x.dtype)

