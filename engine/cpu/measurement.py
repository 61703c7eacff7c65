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

import torch

from ..kernels import native

logger = logging.getLogger(__name__)


def measured(kind: str, key: tuple, measure: Callable[[], float]) -> float:
    """``measure()`` (how many times faster the default path is than its
    alternative), cached per host, library configuration and ``key``."""
    path = native.cache_dir().parent / "cpu_paths.json"
    entry = hashlib.sha256(repr((kind, key, host_key())).encode()).hexdigest()[:24]
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached.get(entry), float):
        return cached[entry]
    speedup = measure()
    cached[entry] = speedup
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(cached, indent=0))
        os.replace(scratch, path)
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
