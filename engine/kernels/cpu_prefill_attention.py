"""Launcher of the CPU causal attention of prefill chunks (cpu_prefill_attention.c).

Each chunk's query tokens attend over its request's context read in place from the
paged KV cache (the step's own keys and values are written there first), as the
decode kernel (kernels/cpu_attention.py) does for single tokens; its plain-torch
reference is ``kernels.paged_attention_reference``. SDPA, its alternative, needs one
call per prompt or copies of the context padded into groups; the engine races the
two on the model's heads at load (engine/cpu/paths.py).

float32 and bfloat16 caches (bfloat16 accumulates in float32), key and value head
sizes a multiple of 16, every AttentionOptions (sliding windows, softcaps, sinks,
ALiBi, chunks) and queries that see later keys (an image's rows attending both ways);
everything else stays with SDPA
(engine/attention/torch_path.py), as it does when the library cannot be built.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native import PAGED_ATTENTION_ARGTYPES, NativeLibrary, call_paged_attention, declare

SOURCE = Path(__file__).with_name("cpu_prefill_attention.c")
_FUNCTIONS = {torch.float32: "prefill_attention_f32", torch.bfloat16: "prefill_attention_bf16"}


def _declare(library: ctypes.CDLL) -> None:
    # The common arguments, then key_limits (int64 [T] or NULL); returns 0, or -1: no scratch memory.
    declare(library, _FUNCTIONS.values(), [*PAGED_ATTENTION_ARGTYPES, ctypes.c_void_p], ctypes.c_int)
    declare(library, ("prefill_attention_max_head_dim",), None, ctypes.c_int64)
    declare(library, ("prefill_amx_ready",), [], ctypes.c_int)
    declare(library, ("prefill_amx_allow",), [ctypes.c_int], None)


_LIBRARY = NativeLibrary(SOURCE, _declare, "prefill chunks attend through SDPA")
DTYPES = tuple(_FUNCTIONS)


def load_library() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None when it cannot be built."""
    return _LIBRARY.load()


def amx_tiles_ready() -> bool:
    """Whether bfloat16 calls multiply through AMX tiles here (cpu_prefill_blocks.h:
    built with AMX-BF16, the tiles granted by the OS and allowed)."""
    library = _LIBRARY.load()
    return library is not None and bool(library.prefill_amx_ready())


def allow_amx_tiles(allowed: bool) -> None:
    """Let bfloat16 calls take AMX tiles where the host has them (the default), or not:
    the dot-product path then runs, as on a host without AMX (tests check both)."""
    library = _LIBRARY.load()
    if library is not None:
        library.prefill_amx_allow(int(allowed))


def prefill_kernel_available(k_cache: torch.Tensor, num_heads: int, value_head_dim: int | None = None) -> bool:
    """Whether the kernel attends over this cache ([N, bs, Hkv, D], values of
    ``value_head_dim``, default D) for ``num_heads`` query heads."""
    head_dim, num_kv_heads = k_cache.shape[3], k_cache.shape[2]
    value_head_dim = value_head_dim or head_dim
    if (k_cache.device.type != "cpu" or k_cache.dtype not in _FUNCTIONS or head_dim % 16 or value_head_dim % 16
            or num_heads % num_kv_heads):
        return False
    library = _LIBRARY.load()
    return library is not None and max(head_dim, value_head_dim) <= library.prefill_attention_max_head_dim()


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      requests: torch.Tensor, out: torch.Tensor, scale: float,
                      sliding_window: int | None = None, softcap: float | None = None,
                      sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                      chunk_size: int | None = None, key_limits: torch.Tensor | None = None) -> None:
    """Causal attention of the query tokens of each request in ``requests`` over its
    paged context (each up to its own position, or up to its ``key_limits`` entry);
    writes their rows of ``out``.

    query: [T, H, D] (D contiguous); k_cache: [N, bs, Hkv, D], v_cache:
    [N, bs, Hkv, Dv], contiguous, holding every context token including this step's;
    block_tables: [B, max_blocks] int32; query_start_loc: [B+1] int64; seq_lens: [B]
    int64 (context length after the step); requests: [n] int64; out: [T, H, Dv]
    contiguous; sinks, alibi_slopes: [H] or None; chunk_size: int or None
    (engine/attention/context.py's AttentionOptions); key_limits: [T] int64, the last
    key position each query row sees (StepBatch.key_limits: an image's rows attending
    both ways see its last), within its request's context, or None.
    """
    library = _LIBRARY.load()
    assert library is not None, "prefill_attention called without prefill_kernel_available"
    assert query.shape[2] % 16 == 0 and v_cache.shape[3] % 16 == 0, (query.shape, v_cache.shape)
    if key_limits is not None:
        assert key_limits.dtype == torch.int64 and key_limits.is_contiguous(), (key_limits.dtype, key_limits.stride())
        assert key_limits.shape == (query.shape[0],) and key_limits.device.type == "cpu", key_limits.shape
    status = call_paged_attention(getattr(library, _FUNCTIONS[query.dtype]), query, k_cache, v_cache, block_tables,
                                  (query_start_loc, seq_lens), requests, out, scale, sliding_window, softcap,
                                  sinks, alibi_slopes, chunk_size,
                                  extra=(None if key_limits is None else key_limits.data_ptr(),))
    if status != 0:
        raise MemoryError("prefill_attention: no memory for the kernel's scratch buffers")
