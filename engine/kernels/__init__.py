"""Triton kernels for the engine, each beside its launcher and a plain-torch reference.

Importing this package never requires Triton: the references always work, and the
launchers raise a RuntimeError when ``triton_available()`` is False.
"""

from ._triton import triton_available
from .paged_attention import paged_attention, paged_attention_reference
from .reshape_and_cache import store_kv_cache, store_kv_cache_reference

__all__ = [
    "paged_attention",
    "paged_attention_reference",
    "store_kv_cache",
    "store_kv_cache_reference",
    "triton_available",
]
