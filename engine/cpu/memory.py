"""glibc's allocator, set for a CPU engine's step-sized temporaries.

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import threading

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD_BYTES = 256 << 20

_lock = threading.Lock()
_applied: bool | None = None


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
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
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
    try:
        malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    malloc_trim(0)
    return True
