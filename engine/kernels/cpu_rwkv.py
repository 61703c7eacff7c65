"""Launcher of RWKV-4's WKV scan on the CPU (cpu_rwkv.c), float32; its plain-torch
reference is rwkv_wkv.py's ``wkv_varlen``. ``rwkv_kernel_available`` says whether the
library built here; without it the rwkv kind keeps the torch scan."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native import NativeLibrary, declare

SOURCE = Path(__file__).with_name("cpu_rwkv.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, ctypes.c_int]


def _declare(library: ctypes.CDLL) -> None:
    declare(library, ["wkv_varlen_f32"], _ARGTYPES, None)


_LIBRARY = NativeLibrary(SOURCE, _declare, "RWKV layers keep their torch WKV scan")


def rwkv_kernel_available() -> bool:
    """Whether the library builds and loads on this host."""
    return _LIBRARY.load() is not None


def _rows(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` [N, A] float32 with a unit last stride (a copy where it has none)."""
    assert tensor.dim() == 2 and tensor.dtype == torch.float32, f"{name}: {tuple(tensor.shape)} {tensor.dtype}"
    return tensor if tensor.stride(1) == 1 else tensor.contiguous()


def wkv_varlen_cpu(decay: torch.Tensor, first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor, num: torch.Tensor, den: torch.Tensor,
                   maximum: torch.Tensor) -> torch.Tensor:
    """rwkv_wkv.wkv_varlen through C, float32: decay = -exp(time_decay) and first [A];
    key, value [T, A]; cu_seqlens [B+1]; has_initial_state [B] bool; num, den, maximum
    [B, A] contiguous, read where has_initial_state and updated in place. Returns [T, A]."""
    library = _LIBRARY.load()
    assert library is not None, "cpu_rwkv.c did not build: check rwkv_kernel_available() first"
    key, value = _rows(key, "key"), _rows(value, "value")
    num_requests, width = cu_seqlens.shape[0] - 1, key.shape[1]
    assert value.shape == key.shape, f"value {tuple(value.shape)} is not key's {tuple(key.shape)}"
    for name, tensor in (("decay", decay), ("first", first)):
        assert tensor.shape == (width,) and tensor.dtype == torch.float32 and tensor.is_contiguous(), name
    for state in (num, den, maximum):
        assert state.shape == (num_requests, width) and state.dtype == torch.float32 and state.is_contiguous(), \
            f"a WKV state must be [{num_requests}, {width}] contiguous float32, got {tuple(state.shape)}"
    cu = cu_seqlens.to(torch.int64).contiguous()
    flags = has_initial_state.to(torch.uint8).contiguous()
    assert flags.shape == (num_requests,), f"has_initial_state {tuple(flags.shape)} for {num_requests} requests"
    out = torch.empty_like(value)
    library.wkv_varlen_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), out.data_ptr(),
                           out.stride(0), decay.data_ptr(), first.data_ptr(), cu.data_ptr(), flags.data_ptr(),
                           num.data_ptr(), den.data_ptr(), maximum.data_ptr(), num_requests, width,
                           torch.get_num_threads())
    return out
