"""Measurements behind the CPU path choices (engine/cpu/paths.py): two ways of running
the same work raced against each other on this host, and the outcome cached per host,
library configuration and shape in the cache directory, so a host pays each once."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..kernels import native

logger = logging.getLogger(__name__)


# Measurements kept in the cache file; past this the oldest go (measured again if
# asked for). Each new kernel build or library version adds a host's set anew.
MAX_ENTRIES = 2048


def _read(path: Path) -> dict:
    """The cache file's measurements; parsed again only when its bytes change (an
    engine's load asks for a few hundred, and the file is rewritten by other
    processes and by tests)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return {}
    if _PARSED.get(path, (None,))[0] != raw:
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = {}
        _PARSED[path] = (raw, parsed if isinstance(parsed, dict) else {})
    return _PARSED[path][1]


_PARSED: dict[Path, tuple[bytes, dict]] = {}


def measured(kind: str, key: tuple, measure: Callable[[], float]) -> float:
    """``measure()`` (how many times faster the default path is than its
    alternative), cached per host, library configuration and ``key``."""
    path = native.cache_dir().parent / "cpu_paths.json"
    entry = hashlib.sha256(repr((kind, key, host_key())).encode()).hexdigest()[:24]
    cached = _read(path)
    if isinstance(cached.get(entry), float):
        return cached[entry]
    speedup = measure()
    cached = dict(_read(path))  # another process may have added measurements meanwhile
    cached[entry] = speedup
    for stale in list(cached)[:max(0, len(cached) - MAX_ENTRIES)]:  # the oldest first
        del cached[stale]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        text = json.dumps(cached, indent=0)
        scratch.write_text(text)
        os.replace(scratch, path)
        _PARSED[path] = (text.encode(), cached)
    except OSError as error:  # a read-only cache directory: measured again next time
        logger.debug("could not cache a CPU path measurement in %s: %s", path, error)
    return speedup


@functools.lru_cache(maxsize=1)
def host_key() -> str:
    """What a measurement depends on besides its shape: the CPU, torch, the thread
    count, the C kernels' sources and build, and every setting that changes which
    instructions the libraries use."""
    settings = {name: os.environ.get(name, "") for name in (
        "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")}
    return repr((native.cpu_signature(), torch.__version__, torch.get_num_threads(), native.kernel_target(),
                 native.kernel_sources_digest(), sorted(settings.items())))


def race(default: Callable[[], object], alternative: Callable[[], object], rounds: int = 5) -> float:
    """Best time of ``alternative`` over best time of ``default``, run interleaved
    (a slow phase of the machine hits both). On one thread both run on the calling
    thread and are timed by its CPU time, which other work on the machine does not
    inflate; on several, by the wall clock."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    # Warm up: oneDNN and the kernels build their code on first use.
    default()
    alternative()
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for index, run in enumerate((default, alternative)):
            start = clock()
            run()
            best[index] = min(best[index], clock() - start)
    return best[1] / best[0]
