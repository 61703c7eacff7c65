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
from collections.abc import Callable
from pathlib import Path

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
