"""Building and loading the engine's C kernels for the CPU path.

Each C source is compiled once per machine with the system's C compiler (``CC``,
else ``cc``) into a cache directory (``SHARDLINE_CACHE_DIR``, default
~/.cache/shardline), first with ``-march=native`` and then without, and called
through ctypes, which releases the GIL for the call. A library that cannot be built
(no compiler, a failed build) loads as None, once, with a warning; its callers then
use their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Included by every source; part of each library's cache key.
COMMON_HEADER = Path(__file__).with_name("cpu_common.h")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    root = os.environ.get("SHARDLINE_CACHE_DIR") or Path.home() / ".cache" / "shardline"
    return Path(root) / "kernels"


def _cpu_signature() -> bytes:
    """Compiled with -march=native: a cached library is valid only for the same CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))})).encode()


def _build(source: Path, compiler: str) -> Path:
    key_material = source.read_bytes() + COMMON_HEADER.read_bytes() + compiler.encode() + _cpu_signature()
    target = _cache_dir() / f"{source.stem}-{hashlib.sha256(key_material).hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in (["-march=native"], []):
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            output = Path(scratch) / target.name
            command = [compiler, "-O3", *flags, "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
                       str(source), "-o", str(output), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode == 0:
                os.replace(output, target)  # atomic: concurrent builders agree on the file
                return target
            errors.append(f"{' '.join(command)}:\n{result.stderr.strip()}")
    raise RuntimeError(f"could not compile {source.name}:\n" + "\n".join(errors))


# The paged attention kernels' common C signature (cpu_decode_attention.c and
# cpu_prefill_attention.c): q and its token and head strides; k_cache, v_cache,
# block_tables and the table's stride; two int64 index arrays (which ones: each
# kernel's header comment), the int64 indices of the requests to attend and their
# number; out, H, Hkv, D, block size; scale, window, softcap and threads.
PAGED_ATTENTION_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    + [ctypes.c_void_p] + [ctypes.c_int64] * 4
    + [ctypes.c_double, ctypes.c_int64, ctypes.c_double, ctypes.c_int]
)


def call_paged_attention(function: Callable, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, indices: tuple[torch.Tensor, torch.Tensor],
                         requests: torch.Tensor, out: torch.Tensor, scale: float, sliding_window: int | None,
                         softcap: float | None) -> object:
    """Check the tensors a paged attention kernel reads and writes and call it (see
    PAGED_ATTENTION_ARGTYPES); returns what it returns. query: [T, H, D] (D
    contiguous); k_cache, v_cache: [N, bs, Hkv, D] contiguous; block_tables:
    [B, max_blocks] int32; indices: the kernel's two int64 index arrays over the B
    requests; requests: [n] int64, which to attend; out: [T, H, D] contiguous; one
    dtype throughout."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert query.dtype == k_cache.dtype == v_cache.dtype == out.dtype, (query.dtype, k_cache.dtype, out.dtype)
    assert query.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim and out.shape == query.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    for index in (*indices, requests):
        assert index.dtype == torch.int64 and index.is_contiguous()
    return function(query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                    block_tables.data_ptr(), block_tables.stride(0), *(index.data_ptr() for index in indices),
                    requests.data_ptr(), requests.numel(), out.data_ptr(), num_heads, num_kv_heads, head_dim,
                    k_cache.shape[1], float(scale), int(sliding_window or 0), float(softcap or 0.0),
                    torch.get_num_threads())


def declare(library: ctypes.CDLL, names: Iterable[str], argtypes: list | None, restype: object) -> None:
    """Set the ctypes signature of each function ``names`` of ``library``."""
    for name in names:
        function = getattr(library, name)
        if argtypes is not None:
            function.argtypes = argtypes
        function.restype = restype


class NativeLibrary:
    """One C source, built and loaded on first use; ``declare`` sets its functions'
    ctypes signatures."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None], fallback: str) -> None:
        self.source = source
        self.declare = declare
        self.fallback = fallback  # what runs instead, for the warning
        self._lock = threading.Lock()
        self._library: ctypes.CDLL | None = None
        self._failed = False

    def load(self) -> ctypes.CDLL | None:
        """The loaded library, or None when it cannot be built here."""
        with self._lock:
            if self._library is None and not self._failed:
                compiler = _compiler()
                try:
                    if compiler is None:
                        raise RuntimeError("no C compiler found (set CC)")
                    library = ctypes.CDLL(str(_build(self.source, compiler)))
                    self.declare(library)
                    self._library = library
                except (RuntimeError, OSError) as error:
                    self._failed = True
                    logger.warning("%s unavailable, %s: %s", self.source.name, self.fallback, error)
            return self._library
