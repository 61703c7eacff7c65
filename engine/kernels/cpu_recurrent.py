"""Launcher of the recurrent core of gated delta-net and Kimi delta attention layers on
the CPU (cpu_recurrent.c); its plain-torch references are in recurrent_reference.py.

One call per layer and step takes the projected q|k|v rows of every request (prefill
chunks and decode tokens alike) through the causal convolution with SiLU, the l2
norms of q and k and the gated delta rule (one log decay per head, or per key channel
for Kimi delta attention), updating each request's convolution window and [K, V]
states in place: what engine/recurrent/gated_delta_net.py and kda.py otherwise run as
conv_varlen's convolution, then a chunked rule or a single-token step.

float32 and float64 (one dtype for the inputs, states and outputs), head sizes up to
MAX_HEAD_DIM, SiLU as the convolution's activation; ``recurrent_kernel_available``
says whether the library built here. Without it the layer keeps its torch path.
``causal_conv1d`` is the convolution alone (with SiLU or none), for the layers whose
recurrence stays in torch (short convolution, Mamba, Mamba-2, RG-LRU);
``ssd_decode_step`` and ``selective_state_update`` a float32 Mamba-2 or Mamba mixer's
decode tokens.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native import NativeLibrary, declare

SOURCE = Path(__file__).with_name("cpu_recurrent.c")
_FUNCTIONS = {torch.float32: "delta_rule_core_f32", torch.float64: "delta_rule_core_f64"}
DTYPES = tuple(_FUNCTIONS)
MAX_HEAD_DIM = 256  # cpu_recurrent.c's
L2_NORM_EPS = 1e-6  # the layer's l2 norm: x / sqrt(sum(x^2) + eps)
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _I, _P, _P, _I, _P, ctypes.c_int, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, ctypes.c_double,
             ctypes.c_double, ctypes.c_int]


_CONV_FUNCTIONS = {torch.float32: "causal_conv1d_f32", torch.float64: "causal_conv1d_f64"}
_CONV_ARGTYPES = [_P, _I, _P, _P, _I, _P, _P, _I, _P, _P, _I, ctypes.c_int, ctypes.c_int]


_SSD_ARGTYPES = [_P, _P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_int]


_SELECTIVE_ARGTYPES = [_P, _P, _I, _P, _I, _P, _P, _P, _I, _P, _P, _I, _P, _I, _I, _I, _I, ctypes.c_int]


def _declare(library: ctypes.CDLL) -> None:
    declare(library, _FUNCTIONS.values(), _ARGTYPES, None)
    declare(library, _CONV_FUNCTIONS.values(), _CONV_ARGTYPES, None)
    declare(library, ["ssd_decode_f32"], _SSD_ARGTYPES, None)
    declare(library, ["selective_decode_f32"], _SELECTIVE_ARGTYPES, None)


_LIBRARY = NativeLibrary(SOURCE, _declare, "gated delta-net and Kimi delta attention layers keep their torch path")


def load_library() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None when it cannot be built."""
    return _LIBRARY.load()


def _built_library() -> ctypes.CDLL:
    """The compiled library, for the kernels below: their callers asked an
    ``*_kernel_available`` first, which built it."""
    library = _LIBRARY.load()
    assert library is not None, "call the matching *_kernel_available first"
    return library


def recurrent_kernel_available(dtype: torch.dtype, key_dim: int, value_dim: int) -> bool:
    """Whether the kernel runs heads of these sizes in ``dtype`` here."""
    return dtype in _FUNCTIONS and max(key_dim, value_dim) <= MAX_HEAD_DIM and _LIBRARY.load() is not None


def decode_kernel_available(dtype: torch.dtype) -> bool:
    """Whether ``ssd_decode_step`` and ``selective_state_update`` run a mixer of ``dtype``
    here (float32 only)."""
    return dtype == torch.float32 and _LIBRARY.load() is not None


def conv_kernel_available(dtype: torch.dtype) -> bool:
    """Whether ``causal_conv1d`` runs ``dtype`` here."""
    return dtype in _CONV_FUNCTIONS and _LIBRARY.load() is not None


def delta_rule_core(mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                         g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
                         has_initial_state: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
                         num_key_heads: int) -> torch.Tensor:
    """mixed_qkv: [T, C] rows (unit last stride), C = 2 Hk K + H V, the q, k and v
    channels side by side before the convolution; conv_weight: [C, W]; conv_bias: [C] or
    None; g (log decay): [T, H], or [T, H, K] for one per key channel; beta: [T, H];
    cu_seqlens: [B + 1]; has_initial_state: [B] bool;
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
    g_per_key = g.dim() == 3
    assert g.shape == ((num_tokens, num_heads, key_dim) if g_per_key else (num_tokens, num_heads)), g.shape
    assert state.is_contiguous() and beta.shape == (num_tokens, num_heads), beta.shape
    assert g.is_contiguous() and beta.is_contiguous()
    for tensor in (mixed_qkv, conv_weight, conv_bias, g, beta, conv_state):
        assert tensor is None or tensor.dtype == dtype, (tensor.dtype, dtype)
    assert cu_seqlens.shape == (num_requests + 1,) and has_initial_state.shape == (num_requests,)
    cu_seqlens = cu_seqlens.to(torch.int64).contiguous()
    flags = has_initial_state.to(torch.uint8).contiguous()
    taps = conv_weight.t().contiguous()  # [W, C]: each tap's weights in a row, as the kernel reads them
    out = torch.empty((num_tokens, num_heads, value_dim), dtype=dtype)
    getattr(_built_library(), _FUNCTIONS[dtype])(
        mixed_qkv.data_ptr(), mixed_qkv.stride(0), taps.data_ptr(),
        None if conv_bias is None else conv_bias.data_ptr(), width, g.data_ptr(), int(g_per_key), beta.data_ptr(),
        cu_seqlens.data_ptr(), flags.data_ptr(), num_requests, conv_state.data_ptr(), state.data_ptr(),
        out.data_ptr(), num_heads, num_key_heads, key_dim, value_dim, key_dim ** -0.5, L2_NORM_EPS,
        torch.get_num_threads())
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                  has_initial_state: torch.Tensor, conv_state: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The depthwise causal convolution alone, as engine/recurrent/conv_varlen.py's
    ``causal_conv1d_varlen`` (its plain-torch reference: recurrent_reference.py's
    ``causal_conv1d_reference``):
    x [T, C] rows (unit last stride); weight [C, W]; bias [C] or None; conv_state
    [B, W-1, C] contiguous, read where has_initial_state and overwritten with each
    request's last W-1 inputs; activation None or "silu". Returns [T, C]."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_requests = cu_seqlens.shape[0] - 1
    assert activation in (None, "silu"), activation
    assert x.device.type == "cpu" and x.stride(1) == 1 and x.dtype in _CONV_FUNCTIONS, (x.device, x.stride(), x.dtype)
    assert weight.shape == (channels, width) and conv_state.shape == (num_requests, width - 1, channels)
    assert conv_state.is_contiguous(), conv_state.stride()
    assert bias is None or (bias.shape == (channels,) and bias.is_contiguous()), bias
    for tensor in (weight, bias, conv_state):
        assert tensor is None or tensor.dtype == x.dtype, (tensor.dtype, x.dtype)
    cu_seqlens = cu_seqlens.to(torch.int64).contiguous()
    flags = has_initial_state.to(torch.uint8).contiguous()
    taps = weight.t().contiguous()  # [W, C]
    out = torch.empty((num_tokens, channels), dtype=x.dtype)
    getattr(_built_library(), _CONV_FUNCTIONS[x.dtype])(
        x.data_ptr(), x.stride(0), taps.data_ptr(), None if bias is None else bias.data_ptr(), width,
        cu_seqlens.data_ptr(), flags.data_ptr(), num_requests, conv_state.data_ptr(), out.data_ptr(), channels,
        int(activation == "silu"), torch.get_num_threads())
    return out


def ssd_decode_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    """One decode token of a Mamba-2 mixer per request, float32, as
    engine/recurrent/ssd.py's ``ssd_decode_step`` (its plain-torch reference): state
    [R, H, P, N] contiguous, updated in place; x [R, H, P] and B, C [R, G, N], each a
    view of rows (any row stride, the rest contiguous); dt [R, H]; A, D [H] (D may be
    None). Returns y [R, H, P]."""
    requests, heads, head_dim, state_size = state.shape
    groups = B.shape[1]
    for tensor in (state, x, dt, A, B, C, D):
        assert tensor is None or (tensor.dtype == torch.float32 and tensor.device.type == "cpu"), tensor.dtype
    assert state.is_contiguous() and heads % groups == 0, (state.stride(), heads, groups)
    assert x.shape == (requests, heads, head_dim) and x.stride()[1:] == (head_dim, 1), (x.shape, x.stride())
    assert B.shape == C.shape == (requests, groups, state_size) and B.stride() == C.stride(), (B.stride(), C.stride())
    assert B.stride()[1:] == (state_size, 1), B.stride()
    dt, A = dt.contiguous(), A.contiguous()
    D = None if D is None else D.contiguous()
    assert dt.shape == (requests, heads) and A.shape == (heads,) and (D is None or D.shape == (heads,))
    y = torch.empty((requests, heads, head_dim), dtype=torch.float32)
    _built_library().ssd_decode_f32(state.data_ptr(), x.data_ptr(), x.stride(0), dt.data_ptr(), A.data_ptr(),
                                    B.data_ptr(), C.data_ptr(), B.stride(0), None if D is None else D.data_ptr(),
                                    y.data_ptr(), requests, heads, groups, head_dim, state_size,
                                    torch.get_num_threads())
    return y


def _rows(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A float32 CPU matrix with contiguous rows: ``tensor`` itself where its rows are."""
    assert tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.dim() == 2, (
        name, tensor.dtype, tensor.shape)
    return tensor if tensor.stride(1) == 1 else tensor.contiguous()


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None
                           ) -> torch.Tensor:
    """One decode token of a Mamba mixer per request, float32, as
    engine/recurrent/selective_scan.py's ``selective_state_update`` (its plain-torch
    reference): state [R, Dc, N] contiguous, updated in place; x, dt (softplus'd), z
    [R, Dc] rows (z may be None); B, C [R, G, N] rows (the rest contiguous); A [Dc, N];
    D [Dc] or None. Returns y [R, Dc]."""
    requests, channels, state_size = state.shape
    groups = B.shape[1]
    assert state.dtype == torch.float32 and state.is_contiguous() and channels % groups == 0, state.stride()
    assert B.shape == C.shape == (requests, groups, state_size), (B.shape, C.shape)
    x, dt = _rows(x, "x"), _rows(dt, "dt")
    z = None if z is None else _rows(z, "z")
    B, C = (t.reshape(requests, groups * state_size) for t in (B, C))  # views where the rows allow
    B, C = _rows(B, "B"), _rows(C, "C")
    if B.stride(0) != C.stride(0):
        B, C = B.contiguous(), C.contiguous()
    A = A.contiguous()
    D = None if D is None else D.contiguous()
    assert x.shape == dt.shape == (requests, channels) and (z is None or z.shape == x.shape), (x.shape, dt.shape)
    assert A.shape == (channels, state_size) and A.dtype == torch.float32 and (D is None or D.shape == (channels,))
    y = torch.empty((requests, channels), dtype=torch.float32)
    _built_library().selective_decode_f32(
        state.data_ptr(), x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), A.data_ptr(), B.data_ptr(),
        C.data_ptr(), B.stride(0), None if D is None else D.data_ptr(), None if z is None else z.data_ptr(),
        0 if z is None else z.stride(0), y.data_ptr(), requests, channels, groups, state_size,
        torch.get_num_threads())
    return y

