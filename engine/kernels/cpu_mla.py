"""Launcher of the CPU absorbed latent-attention decode (cpu_mla.c), and its plain-torch
reference.

A latent layer (engine/attention/mla.py) caches per token one row [c, k_rope] of
W = kv_lora_rank + qk_rope_head_dim numbers for every head. A decode step's query,
absorbed (q_abs = [q_nope W_UK, q_rope] per head, W numbers), scores each row as a
whole and weights the rows' first kv_lora_rank numbers: the kernel returns those
weighted latent sums per head, reading each context row once per run of heads, in
place through the block tables; the caller applies W_UV.

The C source is compiled once per machine and target and called through ctypes
(kernels/native.py). Without a compiler, or if the build fails, ``mla_decode_available``
is False and mla.py's torch path attends instead. float32, float64 and bfloat16
caches (bfloat16 accumulates in float32).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native import NativeLibrary, declare

SOURCE = Path(__file__).with_name("cpu_mla.c")
_FUNCTIONS = {torch.float32: "mla_decode_f32", torch.float64: "mla_decode_f64", torch.bfloat16: "mla_decode_bf16"}
DTYPES = tuple(_FUNCTIONS)
# q, cache, block_tables, table stride, seq_lens, n, out, H, W, r, block size, scale, threads
_ARGTYPES = ([ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
             + [ctypes.c_int64] * 4 + [ctypes.c_double, ctypes.c_int])


def _declare(library: ctypes.CDLL) -> None:
    declare(library, _FUNCTIONS.values(), _ARGTYPES, None)
    declare(library, ("mla_decode_max_width", "mla_decode_max_block"), None, ctypes.c_int64)


_LIBRARY = NativeLibrary(SOURCE, _declare, "using the torch path for latent decode attention")


def load_library() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None when it cannot be built."""
    return _LIBRARY.load()


def mla_decode_available(latent_cache: torch.Tensor) -> bool:
    """Whether the kernel can attend over this latent cache ([N, bs, W])."""
    if latent_cache.device.type != "cpu" or latent_cache.dtype not in _FUNCTIONS:
        return False
    library = load_library()
    if library is None:
        return False
    return (latent_cache.shape[-1] <= library.mla_decode_max_width()
            and latent_cache.shape[1] <= library.mla_decode_max_block())


def mla_decode(q_abs: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               rank: int, scale: float) -> torch.Tensor:
    """Each request's one absorbed query (q_abs [n, H, W]) over its paged latent context
    (latent_cache [N, bs, W], block_tables [n, max_blocks] int32, seq_lens [n] int64
    with the new token): the weighted latent sums [n, H, rank], in the cache's dtype."""
    library = load_library()
    assert library is not None, "mla_decode called without mla_decode_available"
    num_requests, num_heads, width = q_abs.shape
    assert q_abs.dtype == latent_cache.dtype and q_abs.is_contiguous() and latent_cache.is_contiguous()
    assert latent_cache.dim() == 3 and latent_cache.shape[2] == width and 0 < rank <= width, (latent_cache.shape, rank)
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1 and block_tables.shape[0] == num_requests
    assert seq_lens.dtype == torch.int64 and seq_lens.is_contiguous() and seq_lens.shape == (num_requests,)
    out = q_abs.new_empty((num_requests, num_heads, rank))
    getattr(library, _FUNCTIONS[q_abs.dtype])(
        q_abs.data_ptr(), latent_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), num_requests, out.data_ptr(), num_heads, width, rank, latent_cache.shape[1],
        float(scale), torch.get_num_threads())
    return out


def mla_decode_reference(q_abs: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """What ``mla_decode`` computes, in plain torch (one request at a time)."""
    block_size = latent_cache.shape[1]
    out = q_abs.new_empty((*q_abs.shape[:2], rank))
    for request, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_tables[request, : -(-seq_len // block_size)].long()
        rows = latent_cache[blocks].reshape(-1, latent_cache.shape[2])[:seq_len]  # [S, W]
        weights = (q_abs[request] @ rows.T * scale).softmax(dim=-1)  # [H, S]
        out[request] = weights @ rows[:, :rank]
    return out
