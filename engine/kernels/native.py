"""Building and loading the engine's C kernels for the CPU path.

Each C source is compiled once per machine and target with the system's C compiler
(``CC``, else ``cc``) into a cache directory (``SHARDLINE_CACHE_DIR``, default
~/.cache/shardline; one process builds a library while the others wait for it) and
called through ctypes, which releases the GIL for the call.
The target is the host's own instruction set (``-march=native``, and the compiler's
default when it knows no ``native``) unless ``SHARDLINE_CPU_TARGET`` names one (for
example ``x86-64-v3``: AVX2 and FMA, ``x86-64-v4``: AVX-512), which is how the
kernels are built and tested for a narrower host than the one at hand. A library
that cannot be built (no compiler, a failed build) loads as None, once, with a
warning; its callers then use their torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

try:
    import fcntl as _fcntl
except ImportError:  # not POSIX: builds take no inter-process lock (see _build_lock)
    _FCNTL: ModuleType | None = None
else:
    _FCNTL = _fcntl

logger = logging.getLogger(__name__)

# Included by every source; it and every other header beside it are part of each
# library's cache key.
COMMON_HEADER = Path(__file__).with_name("cpu_common.h")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    root = os.environ.get("SHARDLINE_CACHE_DIR") or Path.home() / ".cache" / "shardline"
    return Path(root) / "kernels"


# Every kernel call looks its target up (kernel_target), dozens a decode step, and
# os.environ.get costs about 0.6 us there: it encodes the name and, with the variable
# unset, raises and catches a KeyError. os.environ's own store, the dict its
# assignments (monkeypatch.setenv included) write through to, answers in a dict lookup
# and so always gives the current value; where os.environ has no such store, its get.
_TARGET_VARIABLE = "SHARDLINE_CPU_TARGET"
_ENVIRON_STORE: dict | None = getattr(os.environ, "_data", None)
_ENVIRON_KEY: object = getattr(os.environ, "encodekey", str)(_TARGET_VARIABLE)
_ENVIRON_DECODE: Callable[[object], str] = getattr(os.environ, "decodevalue", str)
_TARGETS: dict[object, str] = {}  # the store's raw values, decoded


def kernel_target() -> str:
    """The ``-march`` the kernels are built for: ``SHARDLINE_CPU_TARGET``, else native."""
    if _ENVIRON_STORE is None:
        return os.environ.get(_TARGET_VARIABLE) or "native"
    raw = _ENVIRON_STORE.get(_ENVIRON_KEY)
    if raw is None:
        return "native"
    target = _TARGETS.get(raw)
    if target is None:
        target = _TARGETS[raw] = _ENVIRON_DECODE(raw) or "native"
    return target


@functools.cache
def compiler_vector_isa(compiler: str, target: str) -> str:
    """The widest vector instruction set ``compiler`` emits for ``-march=target``, by
    its own predefined macros: "avx512", "avx2", "neon", "sse2" or "scalar" (also
    when the compiler does not take the target)."""
    command = [compiler, f"-march={target}", "-dM", "-E", "-x", "c", os.devnull]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 and target == "native":
            result = subprocess.run(command[:1] + command[2:], capture_output=True, text=True)
    except OSError:  # no such compiler
        return "scalar"
    macros = set(re.findall(r"^#define (\w+)", result.stdout, flags=re.MULTILINE))
    for isa, macro in (("avx512", "__AVX512F__"), ("avx2", "__AVX2__"), ("neon", "__ARM_NEON"),
                       ("sse2", "__SSE2__")):
        if macro in macros:
            return isa
    return "scalar"


def cpu_signature() -> bytes:
    """Compiled with -march=native: a cached library is valid only for the same CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))})).encode()


# Every build's flags besides the target. Without trapping math the compiler may
# evaluate both sides of a float comparison's select (a clamp, a running max) as
# vector blends: the kernels read no floating-point exception flags, and their
# results do not change.
BUILD_FLAGS = ("-O3", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")


@functools.lru_cache(maxsize=1)
def kernel_sources_digest() -> str:
    """A digest of every C source and header of the kernels and their build flags:
    what a measurement of the built kernels (cpu/paths.py's races) holds for."""
    digest = hashlib.sha256(" ".join(BUILD_FLAGS).encode())
    for path in sorted(COMMON_HEADER.parent.glob("*.[ch]")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _build(source: Path, compiler: str, target: str) -> Path:
    """The cached library of ``source`` for ``target``, compiled first where missing;
    RuntimeError with the compiler's messages where it cannot be."""
    headers = b"".join(path.read_bytes() for path in sorted(COMMON_HEADER.parent.glob("*.h")))
    key_material = (source.read_bytes() + headers + compiler.encode() + target.encode()
                    + " ".join(BUILD_FLAGS).encode() + cpu_signature())
    library_path = cache_dir() / f"{source.stem}-{hashlib.sha256(key_material).hexdigest()[:16]}.so"
    if library_path.exists():
        return library_path
    library_path.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(library_path):
        if library_path.exists():  # built by another process while this one waited
            return library_path
        return _compile(source, compiler, target, library_path)


@contextlib.contextmanager
def _build_lock(library_path: Path) -> Iterator[None]:
    """Held while this process builds ``library_path``: processes starting at once (a
    worker pool, parallel tests) wait for the one building it, then find it built,
    rather than each compiling every kernel. An exclusive flock on a lock file beside
    the library, released when the build ends or the process dies; the lock files stay
    (removing one could let a waiter and a newcomer lock different files). Where fcntl
    is missing, no lock: each builder compiles, and os.replace still keeps the cached
    file whole."""
    if _FCNTL is None:
        yield
        return
    with open(library_path.with_name(library_path.name + ".lock"), "a") as handle:
        _FCNTL.flock(handle.fileno(), _FCNTL.LOCK_EX)
        try:
            yield
        finally:
            _FCNTL.flock(handle.fileno(), _FCNTL.LOCK_UN)


def _compile(source: Path, compiler: str, target: str, library_path: Path) -> Path:
    """``source`` compiled for ``target`` into ``library_path`` (through a scratch file
    renamed into place)."""
    errors = []
    # A compiler that knows no -march=native (some ARM ones) builds for its default.
    for flags in ([f"-march={target}"], []) if target == "native" else ([f"-march={target}"],):
        with tempfile.TemporaryDirectory(dir=library_path.parent) as scratch:
            output = Path(scratch) / library_path.name
            command = [compiler, *BUILD_FLAGS, *flags, str(source), "-o", str(output), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode == 0:
                os.replace(output, library_path)  # atomic: concurrent builders agree on the file
                return library_path
            errors.append(f"{' '.join(command)}:\n{result.stderr.strip()}")
    raise RuntimeError(f"could not compile {source.name}:\n" + "\n".join(errors))


# The paged attention kernels' common C signature (cpu_decode_attention.c and
# cpu_prefill_attention.c): q and its token and head strides; k_cache, v_cache,
# block_tables and the table's stride; two int64 index arrays (which ones: each
# kernel's header comment), the int64 indices of the requests to attend and their
# number; out, H, Hkv, D, Dv, block size; scale, window, softcap; the float64 sink
# logits and ALiBi slopes ([H] each, or NULL), the chunk size (0: none) and threads.
PAGED_ATTENTION_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    + [ctypes.c_void_p] + [ctypes.c_int64] * 5
    + [ctypes.c_double, ctypes.c_int64, ctypes.c_double]
    + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
)


def _per_head(values: torch.Tensor | None, num_heads: int, name: str) -> torch.Tensor | None:
    """A per-head option as the kernels read it: [H] contiguous float64 on the CPU."""
    if values is None:
        return None
    values = values.detach().to(device="cpu", dtype=torch.float64).contiguous()
    assert values.shape == (num_heads,), f"{name} {tuple(values.shape)}, expected [{num_heads}]"
    return values


def call_paged_attention(function: Callable, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, indices: tuple[torch.Tensor, torch.Tensor],
                         requests: torch.Tensor, out: torch.Tensor, scale: float, sliding_window: int | None,
                         softcap: float | None, sinks: torch.Tensor | None = None,
                         alibi_slopes: torch.Tensor | None = None, chunk_size: int | None = None,
                         extra: tuple = ()) -> object:
    """Check the tensors a paged attention kernel reads and writes and call it (see
    PAGED_ATTENTION_ARGTYPES); returns what it returns. query: [T, H, D] (D
    contiguous); k_cache: [N, bs, Hkv, D], v_cache: [N, bs, Hkv, Dv], contiguous;
    block_tables: [B, max_blocks] int32; indices: the kernel's two int64 index arrays
    over the B requests; requests: [n] int64, which to attend; out: [T, H, Dv]
    contiguous; one dtype throughout; sinks, alibi_slopes: [H] or None (see
    engine/attention/context.py's AttentionOptions); ``extra``: arguments a kernel takes
    after the common ones (its header comment says which)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    assert query.dtype == k_cache.dtype == v_cache.dtype == out.dtype, (query.dtype, k_cache.dtype, out.dtype)
    assert query.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()
    assert k_cache.shape[:3] == v_cache.shape[:3] and k_cache.shape[3] == head_dim, (k_cache.shape, v_cache.shape)
    assert out.shape == (*query.shape[:2], head_dim_v), (out.shape, query.shape, head_dim_v)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    first, second = indices
    for index in (first, second, requests):
        assert index.dtype == torch.int64 and index.is_contiguous()
    # Kept alive through the call; None (the common case) skips the conversion's call.
    sinks = None if sinks is None else _per_head(sinks, num_heads, "sinks")
    alibi_slopes = None if alibi_slopes is None else _per_head(alibi_slopes, num_heads, "alibi_slopes")
    return function(query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                    block_tables.data_ptr(), block_tables.stride(0), first.data_ptr(), second.data_ptr(),
                    requests.data_ptr(), requests.numel(), out.data_ptr(), num_heads, num_kv_heads, head_dim,
                    head_dim_v, k_cache.shape[1], float(scale), int(sliding_window or 0), float(softcap or 0.0),
                    None if sinks is None else sinks.data_ptr(),
                    None if alibi_slopes is None else alibi_slopes.data_ptr(), int(chunk_size or 0),
                    torch.get_num_threads(), *extra)


# Every function ``declare`` set up: what kernels/programs.py's recorder watches.
DECLARED: list[Any] = []


def declare(library: ctypes.CDLL, names: Iterable[str], argtypes: list | None, restype: object) -> None:
    """Set the ctypes signature of each function ``names`` of ``library``."""
    for name in names:
        function = getattr(library, name)
        if argtypes is not None:
            function.argtypes = argtypes
        function.restype = restype
        DECLARED.append(function)


class NativeLibrary:
    """One C source, built and loaded on first use for each target (``kernel_target``);
    ``declare`` sets its functions' ctypes signatures."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None], fallback: str) -> None:
        self.source = source
        self.declare = declare
        self.fallback = fallback  # what runs instead, for the warning
        self._lock = threading.Lock()
        self._libraries: dict[str, ctypes.CDLL | None] = {}  # by target; None: cannot be built

    def load(self) -> ctypes.CDLL | None:
        """The library built for the current target, or None when it cannot be built here."""
        target = kernel_target()
        try:  # entries are only ever added, so no lock to read one
            return self._libraries[target]
        except KeyError:  # once a target
            pass
        with self._lock:
            if target not in self._libraries:
                self._libraries[target] = self._build_and_load(target)
            return self._libraries[target]

    def _build_and_load(self, target: str) -> ctypes.CDLL | None:
        compiler = _compiler()
        try:
            if compiler is None:
                raise RuntimeError("no C compiler found (set CC)")
            library = ctypes.CDLL(str(_build(self.source, compiler, target)))
            self.declare(library)
            return library
        except (RuntimeError, OSError) as error:
            logger.warning("%s unavailable for -march=%s, %s: %s", self.source.name, target, self.fallback, error)
            return None


def built_vector_isa() -> str | None:
    """The vector instruction set the kernels are built with for the current target
    (see ``compiler_vector_isa``), or None without a working C compiler."""
    compiler = _compiler()
    if compiler is None or shutil.which(compiler) is None:
        return None
    return compiler_vector_isa(compiler, kernel_target())
