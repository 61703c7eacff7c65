"""Measurements behind the CPU path choices (engine/cpu/paths.py): two ways of running
the same work raced against each other on this host, and the outcome cached per host,
library configuration and shape in the cache directory, so a host pays each once.

Invariants: one process on a host measures at a time (an exclusive lock on a file
beside the cache, held while one measurement runs), and a process that waited for
the lock reads the cache again before measuring: processes that load the same model
together, as a Ray node's workers do, race each shape once between them, and no race
is slowed by another running beside it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
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
    entry = entry_name(kind, key)
    cached = _read(path).get(entry)
    if isinstance(cached, float):
        return cached
    with _measuring(path):
        cached = _read(path).get(entry)  # measured by a process this one waited for
        return cached if isinstance(cached, float) else _measure_and_store(path, entry, measure)


def entry_name(kind: str, key: tuple) -> str:
    """The cache file's name for a measurement of ``kind`` and ``key`` on this host."""
    return hashlib.sha256(repr((kind, key, host_key())).encode()).hexdigest()[:24]


def _measure_and_store(path: Path, entry: str, measure: Callable[[], float]) -> float:
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


# Longest a process waits for another's measurement before measuring beside it (a
# measurement takes seconds; a process stopped while holding the lock holds it on).
LOCK_WAIT_S = 300.0
LOCK_POLL_S = 0.02
_HELD = threading.RLock()  # the lock's holder in this process: its threads take turns, reentrant
_held_depth = 0


@contextlib.contextmanager
def _measuring(path: Path) -> Iterator[None]:
    """Held while this process measures: an exclusive lock on ``path``'s lock file (a
    read-only cache directory, or a lock not given up within LOCK_WAIT_S, measures
    without it)."""
    global _held_depth
    with _HELD:
        if _held_depth:  # a measurement inside another of this process: the lock is held
            yield
            return
        _held_depth += 1
        try:
            with _file_lock(path.with_suffix(".lock")):
                yield
        finally:
            _held_depth -= 1


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no POSIX locks (Windows): measured without one
        yield
        return
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as error:
        logger.debug("measuring without the lock %s: %s", lock_path, error)
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logger.warning("measuring a CPU path beside another process that has held %s for %.0f s",
                                   lock_path, LOCK_WAIT_S)
                    break
                time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(descriptor)  # gives up the lock, where it was taken


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
