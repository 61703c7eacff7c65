"""Launcher of the CPU paged decode attention (cpu_decode_attention.c).

The C source is compiled once per machine and called through ctypes (see
kernels/native.py). Without a compiler, or if the build fails,
``decode_kernel_available`` is False and the engine's torch path
(engine/attention/torch_path.py) attends decoding requests.

Why a native kernel: a decode step is bound by reading every running request's
context once per layer. Torch ops must first gather the paged blocks into a padded
copy (or issue one SDPA call per request), which costs about five times the read
itself on a 2-core worker; the kernel reads each K/V row once, in place.
float32, float64 and bfloat16 caches (bfloat16 accumulates in float32).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native import PAGED_ATTENTION_ARGTYPES, NativeLibrary, call_paged_attention, declare

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
_FUNCTIONS = {torch.float32: "decode_attention_f32", torch.float64: "decode_attention_f64",
              torch.bfloat16: "decode_attention_bf16"}  # bfloat16 accumulates in float32


def _declare(library: ctypes.CDLL) -> None:
    declare(library, _FUNCTIONS.values(), PAGED_ATTENTION_ARGTYPES, None)
    declare(library, ("decode_attention_max_group", "decode_attention_max_head_dim", "decode_attention_max_block"),
            None, ctypes.c_int64)


_LIBRARY = NativeLibrary(SOURCE, _declare, "using the torch path for decode attention")


DTYPES = tuple(_FUNCTIONS)


def load_library() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None when it cannot be built."""
    return _LIBRARY.load()


def decode_kernel_available(k_cache: torch.Tensor, num_heads: int, value_head_dim: int | None = None) -> bool:
    """Whether the kernel can attend over this cache ([N, bs, Hkv, D], values of
    ``value_head_dim``, default D) for ``num_heads`` heads."""
    if k_cache.device.type != "cpu" or k_cache.dtype not in _FUNCTIONS:
        return False
    library = load_library()
    if library is None:
        return False
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return (num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= library.decode_attention_max_group()
            and max(head_dim, value_head_dim or head_dim) <= library.decode_attention_max_head_dim()
            and block_size <= library.decode_attention_max_block())


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_rows: torch.Tensor,
    requests: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> None:
    """Attention of the single query token of each request in ``requests`` over its
    paged context; writes their rows of ``out``.

    query: [T, H, D] (D contiguous); k_cache: [N, bs, Hkv, D], v_cache:
    [N, bs, Hkv, Dv], contiguous; block_tables: [B, max_blocks] int32; seq_lens,
    query_rows: [B] int64 (context length with the new token, packed row of the
    query); requests: [n] int64; out: [T, H, Dv] contiguous, same dtype as the cache;
    sinks, alibi_slopes: [H] or None; chunk_size: int or None (engine/attention/
    context.py's AttentionOptions).
    """
    library = load_library()
    assert library is not None, "decode_attention called without decode_kernel_available"
    call_paged_attention(getattr(library, _FUNCTIONS[query.dtype]), query, k_cache, v_cache, block_tables,
                         (seq_lens, query_rows), requests, out, scale, sliding_window, softcap, sinks, alibi_slopes,
                         chunk_size)
