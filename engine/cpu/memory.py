"""Process memory for a CPU engine: glibc's allocator set for step-sized temporaries,
and huge pages for the paged KV cache.

Every step of a CPU engine allocates and frees the same few large temporaries: a
2048-token step's gate and up projections alone are [2048, 3072] float32, 25 MB.
glibc serves a request above its mmap threshold with a fresh mapping and unmaps it on
free, so each of those tensors page-faults on every page it touches, every step. The
threshold adapts upward on its own, but not reliably: once a library such as
tokenizers has been imported, a step's temporaries can keep faulting on every page
of every call.

``keep_freed_memory`` fixes the threshold at glibc's largest (32 MB on 64-bit) and
raises the trim threshold, so freed step temporaries stay in the heap for the next
step instead of going back to the kernel. Peak memory is unchanged: what is kept is
what the next step allocates again. Set SHARDLINE_MALLOC_TUNING=0 to leave the
allocator alone (for example under jemalloc or tcmalloc, where it does not apply).

``huge_page_zeros`` allocates the KV cache's buffers with the kernel asked for
transparent huge pages: a decode step reads scattered blocks across all of the cache,
and with 4 KiB pages most of those reads also miss the TLB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD_BYTES = 256 << 20

_lock = threading.Lock()
_applied: bool | None = None


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library (errno kept for its calls), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process (once); returns whether
    they are set. False off glibc, when SHARDLINE_MALLOC_TUNING=0, or if glibc refuses."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if os.environ.get("SHARDLINE_MALLOC_TUNING", "1") == "0":
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not applied:
        logger.info("glibc refused the engine's malloc thresholds; large temporaries are mapped per step")
    return applied


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel once (glibc's malloc_trim): after a
    one-off burst of temporaries no step allocates again (a quantized checkpoint's
    conversion at load), which the raised trim threshold would otherwise keep resident
    between the tensors kept. Returns whether it ran; False off glibc or with
    SHARDLINE_MALLOC_TUNING=0."""
    if os.environ.get("SHARDLINE_MALLOC_TUNING", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    malloc_trim(0)
    return True


MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE_BYTES = 2 << 20
HUGE_PAGE_MIN_BYTES = 8 << 20  # below this a tensor spans too few huge pages to matter


@functools.cache
def _madvise_function() -> Any:
    """libc's madvise, or None off Linux or where it cannot be loaded."""
    function = getattr(_libc(), "madvise", None) if platform.system() == "Linux" else None
    if function is not None:
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        function.restype = ctypes.c_int
    return function


def huge_page_zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory the kernel is asked to back with transparent huge
    pages (Linux's madvise(MADV_HUGEPAGE) over the tensor's whole 2 MiB pages, before
    its first touch), for the large buffers a step reads through once, such as the
    paged KV cache: with 4 KiB pages a decode step's scattered block reads miss the TLB
    on most pages. The advice only helps; where the kernel refuses it (huge pages
    "never", no Linux) the tensor is the same zeros in ordinary pages.
    SHARDLINE_HUGE_PAGES=0 leaves the pages alone."""
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    madvise = _madvise_function() if nbytes >= HUGE_PAGE_MIN_BYTES else None
    if madvise is not None and os.environ.get("SHARDLINE_HUGE_PAGES", "1") != "0":
        start = -(-tensor.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        end = (tensor.data_ptr() + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if end > start and madvise(start, end - start, MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d): the buffer keeps 4 KiB pages",
                         ctypes.get_errno())
    return tensor.zero_()
