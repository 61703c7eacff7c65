"""Launchers of the fused elementwise kernels for the CPU path (cpu_fused.c), each
beside its plain-torch reference (transformers' formula, op for op).

float32 and bfloat16 tensors on the CPU; ``fused_kernels_available(dtype)`` says
whether the library built here and takes the dtype. Without it the callers keep the
torch ops (engine/cpu/layers.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from .native import NativeLibrary, declare

SOURCE = Path(__file__).with_name("cpu_fused.c")
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _D, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
_SIGNATURES = {
    "rms_norm": [_P, _I, _P, _P, _I, _I, _I, _D, _N],
    "rms_norm_heads": [_P, _I, _I, _P, _P, _I, _I, _D, _N],
    "add_rms_norm": [_P, _I, _P, _I, _P, _P, _I, _I, _I, _D, _N],
    "add_rows": [_P, _I, _P, _I, _I, _I, _N],
    "silu_mul": [_P, _I, _P, _I, _I, _I, _N],
    "rotary": [_P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _N],
}
_KV_WRITE = [_P, _I, _P, _I, _P, _P, _I, _P, _I, _I, _I]


def _declare(library: ctypes.CDLL) -> None:
    for name, argtypes in _SIGNATURES.items():
        declare(library, [f"{name}_{suffix}" for suffix in _SUFFIXES.values()], argtypes, None)
    declare(library, ["kv_write"], _KV_WRITE, ctypes.c_int64)
    declare(library, ["kv_write_noting"], [*_KV_WRITE, _P], None)


_LIBRARY = NativeLibrary(SOURCE, _declare, "decoder layers keep their torch elementwise ops")


def fused_kernels_available(dtype: torch.dtype) -> bool:
    return dtype in _SUFFIXES and _LIBRARY.load() is not None


# Each library's functions by (name, dtype): every fused kernel call looks its function up.
_FUNCTIONS: dict[tuple[ctypes.CDLL, str, torch.dtype], Callable] = {}


def _function(name: str, dtype: torch.dtype) -> Callable:
    library = _LIBRARY.load()
    function = _FUNCTIONS.get((library, name, dtype)) if library is not None else None
    if function is None:
        assert library is not None and dtype in _SUFFIXES, "call fused_kernels_available first"
        function = _FUNCTIONS[(library, name, dtype)] = getattr(library, f"{name}_{_SUFFIXES[dtype]}")
    return function


def _check_rows(*tensors: torch.Tensor) -> None:
    """Each a CPU matrix with contiguous rows (any row stride), one dtype."""
    for tensor in tensors:
        assert tensor.is_cpu and tensor.dim() == 2 and tensor.stride(1) == 1, (
            tensor.device, tensor.shape, tensor.stride())
        assert tensor.dtype == tensors[0].dtype, (tensor.dtype, tensors[0].dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [rows, cols] -> new [rows, cols]: weight * x / sqrt(mean(x^2) + eps)."""
    out = torch.empty(x.shape, dtype=x.dtype)
    _check_rows(x, out)
    assert weight.is_contiguous() and weight.shape == (x.shape[1],) and weight.dtype == x.dtype
    _function("rms_norm", x.dtype)(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                                   x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H, D], each token's heads contiguous (tokens any stride apart, as q's or
    k's heads are in a q/k/v projection's output) -> new [T * H, D]: rms_norm of each
    head's row, without first copying x's heads together."""
    tokens, heads, head_dim = x.shape
    assert x.is_cpu and x.stride(2) == 1 and x.stride(1) == head_dim, (x.shape, x.stride())
    assert weight.is_contiguous() and weight.shape == (head_dim,) and weight.dtype == x.dtype
    out = torch.empty((tokens * heads, head_dim), dtype=x.dtype)
    _function("rms_norm_heads", x.dtype)(x.data_ptr(), x.stride(0), heads, weight.data_ptr(), out.data_ptr(), tokens,
                                         head_dim, eps, torch.get_num_threads())
    return out


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place; returns rms_norm(x) as a new tensor. x, delta: [rows, cols]."""
    out = torch.empty(x.shape, dtype=x.dtype)
    _check_rows(x, delta, out)
    assert delta.shape == x.shape and weight.is_contiguous() and weight.shape == (x.shape[1],)
    assert weight.dtype == x.dtype
    _function("add_rms_norm", x.dtype)(x.data_ptr(), x.stride(0), delta.data_ptr(), delta.stride(0),
                                       weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1],
                                       eps, torch.get_num_threads())
    return out


def add_(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """x += delta in place (x, delta: [rows, cols]), as torch's add_ rounds; returns x."""
    _check_rows(x, delta)
    assert delta.shape == x.shape, (delta.shape, x.shape)
    _function("add_rows", x.dtype)(x.data_ptr(), x.stride(0), delta.data_ptr(), delta.stride(0), x.shape[0],
                                   x.shape[1], torch.get_num_threads())
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 I] (gate, then up) -> new [rows, I]: silu(gate) * up."""
    rows, width = gate_up.shape
    assert width % 2 == 0, width
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    _check_rows(gate_up, out)
    _function("silu_mul", gate_up.dtype)(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0),
                                         rows, width // 2, torch.get_num_threads())
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] (or no k) in place (heads and D contiguous
    within a token) by cos, sin [T, D], rotating half: pairs (i, i + D / 2)."""
    tokens, _, head_dim = q.shape
    for x in (q, k) if k is not None else (q,):
        assert x.is_cpu and x.dtype == q.dtype and x.shape[0] == tokens and x.shape[2] == head_dim
        assert x.stride(2) == 1 and x.stride(1) == head_dim, x.stride()
    for table in (cos, sin):
        assert table.is_contiguous() and table.shape == (tokens, head_dim) and table.dtype == q.dtype
    assert head_dim % 2 == 0, head_dim
    k_args = (k.data_ptr(), k.stride(0), k.shape[1]) if k is not None else (q.data_ptr(), q.stride(0), 0)
    _function("rotary", q.dtype)(q.data_ptr(), q.stride(0), q.shape[1], *k_args,
                                 cos.data_ptr(), sin.data_ptr(), tokens, head_dim, torch.get_num_threads())


def kv_write_takes(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> bool:
    """Whether ``kv_write`` takes these: CPU tensors, keys and values of their cache's
    dtype and [Hkv, D] shape with each token's row contiguous, contiguous caches,
    contiguous int64 slots, the library built here."""
    return (key.is_cpu and key.dtype == k_cache.dtype and value.dtype == v_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.is_cpu and v_cache.is_cpu
            and key.shape[1:] == k_cache.shape[2:] and value.shape[1:] == v_cache.shape[2:]
            and k_cache.shape[:2] == v_cache.shape[:2] and key.shape[0] == value.shape[0] == slot_mapping.shape[0]
            and _rows_contiguous(key) and _rows_contiguous(value)
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.is_cpu
            and _LIBRARY.load() is not None)


def _rows_contiguous(x: torch.Tensor) -> bool:
    """x [T, H, D]: each token's H x D elements contiguous (tokens any stride apart)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def kv_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache and v_cache [N, bs, Hkv, D] at flat slot slot_mapping[t] <- key[t] and
    value[t] ([T, Hkv, D]), as index_copy_ into their [N * bs, Hkv, D] views does (call
    where ``kv_write_takes``). A slot out of range raises IndexError, nothing written."""
    library = _LIBRARY.load()
    assert library is not None, "call kv_write_takes first"
    out_of_range = library.kv_write(*_kv_write_arguments(key, value, k_cache, v_cache, slot_mapping))
    if out_of_range:
        raise kv_slots_error(out_of_range, key.shape[0], k_cache)


def kv_write_noting(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, out_of_range: torch.Tensor) -> None:
    """``kv_write``, with the count of slots out of range (nothing written then) kept
    in ``out_of_range`` ([1] int64) where it passes the count there, instead of raised:
    a recorded decode step replays this call for each layer (engine/cpu/
    decode_programs.py) and reads the count after."""
    library = _LIBRARY.load()
    assert library is not None, "call kv_write_takes first"
    assert out_of_range.dtype == torch.int64 and out_of_range.numel() == 1 and out_of_range.is_cpu
    library.kv_write_noting(*_kv_write_arguments(key, value, k_cache, v_cache, slot_mapping),
                            out_of_range.data_ptr())


def kv_slots_error(out_of_range: int, tokens: int, k_cache: torch.Tensor) -> IndexError:
    """The error of a write whose slots fall outside the cache."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    return IndexError(f"{out_of_range} of {tokens} KV cache slots outside the cache's {num_slots}")


def _kv_write_arguments(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> tuple[int, ...]:
    k_size, v_size = key.element_size(), value.element_size()
    # Contiguous caches: a slot's row is stride(1) elements.
    return (key.data_ptr(), key.stride(0) * k_size, value.data_ptr(), value.stride(0) * v_size, k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.shape[0] * k_cache.shape[1], slot_mapping.data_ptr(), key.shape[0],
            k_cache.stride(1) * k_size, v_cache.stride(1) * v_size)


# Plain-torch references: transformers' Llama-family formulas.

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]
