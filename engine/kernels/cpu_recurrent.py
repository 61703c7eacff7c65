"""Launcher of the gated delta-net's recurrent core on the CPU (cpu_recurrent.c), beside
its plain-torch reference.

One call per layer and step takes the projected q|k|v rows of every request (prefill
chunks and decode tokens alike) through the causal convolution with SiLU, the l2
norms of q and k and the gated delta rule, updating each request's convolution window
and [K, V] states in place: what engine/recurrent/gated_delta_net.py otherwise runs as
conv_varlen's convolution, then delta_rule's chunked rule or single-token step.

float32 and float64 (one dtype for the inputs, states and outputs), head sizes up to
MAX_HEAD_DIM, SiLU as the convolution's activation; ``recurrent_kernel_available``
says whether the library built here. Without it the layer keeps its torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native import NativeLibrary, declare

SOURCE = Path(__file__).with_name("cpu_recurrent.c")
_FUNCTIONS = {torch.float32: "gated_delta_net_f32", torch.float64: "gated_delta_net_f64"}
DTYPES = tuple(_FUNCTIONS)
MAX_HEAD_DIM = 256  # cpu_recurrent.c's
L2_NORM_EPS = 1e-6  # the layer's l2 norm: x / sqrt(sum(x^2) + eps)
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _I, _P, _P, _I, _P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, ctypes.c_double,
             ctypes.c_double, ctypes.c_int]


def _declare(library: ctypes.CDLL) -> None:
    declare(library, _FUNCTIONS.values(), _ARGTYPES, None)


_LIBRARY = NativeLibrary(SOURCE, _declare, "gated delta-net layers keep their torch path")


def load_library() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None when it cannot be built."""
    return _LIBRARY.load()


def recurrent_kernel_available(dtype: torch.dtype, key_dim: int, value_dim: int) -> bool:
    """Whether the kernel runs heads of these sizes in ``dtype`` here."""
    return dtype in _FUNCTIONS and max(key_dim, value_dim) <= MAX_HEAD_DIM and _LIBRARY.load() is not None


def gated_delta_net_core(mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                         g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
                         has_initial_state: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
                         num_key_heads: int) -> torch.Tensor:
    """mixed_qkv: [T, C] rows (unit last stride), C = 2 Hk K + H V, the q, k and v
    channels side by side before the convolution; conv_weight: [C, W]; conv_bias: [C] or
    None; g (log decay), beta: [T, H]; cu_seqlens: [B + 1]; has_initial_state: [B] bool;
    conv_state: [B, W-1, C] and state: [B, H, K, V], contiguous, read where
    has_initial_state and overwritten with each request's last window and state.
    Returns the delta rule's outputs [T, H, V] (q scaled by K^-0.5 after its norm)."""
    num_tokens, channels = mixed_qkv.shape
    num_requests, num_heads, key_dim, value_dim = state.shape
    width = conv_weight.shape[1]
    dtype = state.dtype
    assert mixed_qkv.device.type == "cpu" and mixed_qkv.stride(1) == 1, (mixed_qkv.device, mixed_qkv.stride())
    assert channels == 2 * num_key_heads * key_dim + num_heads * value_dim, (channels, num_key_heads, state.shape)
    assert num_heads % num_key_heads == 0 and max(key_dim, value_dim) <= MAX_HEAD_DIM, (num_heads, state.shape)
    assert conv_weight.shape == (channels, width) and conv_weight.is_contiguous(), conv_weight.shape
    assert conv_bias is None or (conv_bias.shape == (channels,) and conv_bias.is_contiguous())
    assert conv_state.shape == (num_requests, width - 1, channels) and conv_state.is_contiguous(), conv_state.shape
    assert state.is_contiguous() and g.shape == beta.shape == (num_tokens, num_heads), (g.shape, beta.shape)
    assert g.is_contiguous() and beta.is_contiguous()
    for tensor in (mixed_qkv, conv_weight, conv_bias, g, beta, conv_state):
        assert tensor is None or tensor.dtype == dtype, (tensor.dtype, dtype)
    assert cu_seqlens.shape == (num_requests + 1,) and has_initial_state.shape == (num_requests,)
    cu_seqlens = cu_seqlens.to(torch.int64).contiguous()
    flags = has_initial_state.to(torch.uint8).contiguous()
    taps = conv_weight.t().contiguous()  # [W, C]: each tap's weights in a row, as the kernel reads them
    out = torch.empty((num_tokens, num_heads, value_dim), dtype=dtype)
    getattr(_LIBRARY.load(), _FUNCTIONS[dtype])(
        mixed_qkv.data_ptr(), mixed_qkv.stride(0), taps.data_ptr(),
        None if conv_bias is None else conv_bias.data_ptr(), width, g.data_ptr(), beta.data_ptr(),
        cu_seqlens.data_ptr(), flags.data_ptr(), num_requests, conv_state.data_ptr(), state.data_ptr(),
        out.data_ptr(), num_heads, num_key_heads, key_dim, value_dim, key_dim ** -0.5, L2_NORM_EPS,
        torch.get_num_threads())
    return out


def gated_delta_net_core_reference(mixed_qkv: torch.Tensor, conv_weight: torch.Tensor,
                                   conv_bias: torch.Tensor | None, g: torch.Tensor, beta: torch.Tensor,
                                   cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
                                   conv_state: torch.Tensor, state: torch.Tensor, num_key_heads: int
                                   ) -> torch.Tensor:
    """``gated_delta_net_core`` in plain torch, one request at a time, token by token
    (engine/recurrent's references of the convolution and the delta rule)."""
    from ..recurrent.conv_varlen import causal_conv1d_reference
    from ..recurrent.delta_rule import gated_delta_rule_reference, l2_normalize

    num_heads, key_dim, value_dim = state.shape[1:]
    key_channels = num_key_heads * key_dim
    outputs = []
    for b in range(cu_seqlens.shape[0] - 1):
        rows = mixed_qkv[int(cu_seqlens[b]):int(cu_seqlens[b + 1])]
        initial = bool(has_initial_state[b])
        convolved, conv_state[b] = causal_conv1d_reference(rows, conv_weight, conv_bias,
                                                           conv_state[b] if initial else None, "silu")
        query, key, value = torch.split(convolved, [key_channels, key_channels, num_heads * value_dim], dim=-1)
        query, key = (l2_normalize(x.reshape(len(rows), num_key_heads, key_dim)).repeat_interleave(
            num_heads // num_key_heads, dim=1) for x in (query, key))
        out, state[b] = gated_delta_rule_reference(query * key_dim ** -0.5, key,
                                                   value.reshape(len(rows), num_heads, value_dim),
                                                   g[int(cu_seqlens[b]):int(cu_seqlens[b + 1])],
                                                   beta[int(cu_seqlens[b]):int(cu_seqlens[b + 1])],
                                                   state[b] if initial else None)
        outputs.append(out)
    return torch.cat(outputs)
