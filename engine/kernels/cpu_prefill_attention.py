"""Launcher of the CPU causal attention of fresh prompts (cpu_prefill_attention.c),
beside its plain-torch reference.

A fresh prompt (no cached context) attends only to its own keys and values, which
the step has just computed: the kernel reads them from the step's packed tensors,
never from the paged cache. On the benchmark's prompts (32-512 tokens, 8 heads of
64 over 4 KV heads, 2 cores) it takes about 0.6 of the time of one SDPA call per
prompt. float32 only, head sizes a multiple of 16, sliding windows but no softcap;
everything else stays with SDPA (engine/torch_attention.py), as it does when the
library cannot be built.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native import NativeLibrary

SOURCE = Path(__file__).with_name("cpu_prefill_attention.c")
_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 3  # q, k, v and their token and head strides
    + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]  # out, bounds, number of prompts
    + [ctypes.c_int64] * 3  # H, Hkv, D
    + [ctypes.c_double, ctypes.c_int64, ctypes.c_int]  # scale, window, threads
)


def _declare(library: ctypes.CDLL) -> None:
    library.prefill_attention_f32.argtypes = _ARGTYPES
    library.prefill_attention_f32.restype = ctypes.c_int
    library.prefill_attention_max_head_dim.restype = ctypes.c_int64


_LIBRARY = NativeLibrary(SOURCE, _declare, "fresh prompts attend through SDPA")


def prefill_kernel_available(query: torch.Tensor, key: torch.Tensor, softcap: float | None) -> bool:
    """Whether the kernel takes this step's query [T, H, D] and key [T, Hkv, D]."""
    head_dim = query.shape[-1]
    if (query.device.type != "cpu" or query.dtype != torch.float32 or key.dtype != torch.float32
            or softcap is not None or head_dim % 16 or query.shape[1] % key.shape[1]):
        return False
    library = _LIBRARY.load()
    return library is not None and head_dim <= library.prefill_attention_max_head_dim()


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      bounds: list[tuple[int, int]], out: torch.Tensor, scale: float,
                      sliding_window: int | None = None) -> None:
    """Causal attention of each fresh prompt's rows (first, end) of ``bounds`` over
    its own keys and values; writes those rows of ``out``.

    query: [T, H, D]; key, value: [T, Hkv, D] (D contiguous, any token and head
    strides); out: [T, H, D] contiguous.
    """
    library = _LIBRARY.load()
    assert library is not None, "prefill_attention called without prefill_kernel_available"
    num_heads, head_dim = query.shape[1], query.shape[2]
    for tensor in (query, key, value, out):
        assert tensor.dtype == torch.float32 and tensor.stride(2) == 1 and tensor.shape[2] == head_dim
    assert key.shape == value.shape and out.shape == query.shape and out.is_contiguous()
    assert num_heads % key.shape[1] == 0 and head_dim % 16 == 0, (num_heads, key.shape[1], head_dim)
    assert all(0 <= first < end <= query.shape[0] for first, end in bounds), bounds
    table = torch.tensor(bounds, dtype=torch.int64).reshape(-1, 2)
    status = library.prefill_attention_f32(
        query.data_ptr(), query.stride(0), query.stride(1), key.data_ptr(), key.stride(0), key.stride(1),
        value.data_ptr(), value.stride(0), value.stride(1), out.data_ptr(), table.data_ptr(), table.shape[0],
        num_heads, key.shape[1], head_dim, float(scale), int(sliding_window or 0), torch.get_num_threads())
    if status != 0:
        raise MemoryError("prefill_attention: no memory for the kernel's scratch buffers")


def prefill_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                bounds: list[tuple[int, int]], scale: float,
                                sliding_window: int | None = None) -> torch.Tensor:
    """The kernel's result in plain torch, float64: [T, H, D] with the prompts' rows
    filled, zeros elsewhere."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = query.shape[1] // key.shape[1]
    for first, end in bounds:
        q = query[first:end].double().transpose(0, 1)  # [H, L, D]
        k = key[first:end].double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = value[first:end].double().repeat_interleave(group, dim=1).transpose(0, 1)
        positions = torch.arange(end - first)
        distance = positions[:, None] - positions[None, :]
        allowed = distance >= 0
        if sliding_window is not None:
            allowed &= distance < sliding_window
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
        out[first:end] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)
    return out
