"""Retrying storage operations where they happen: transient errors only, for minutes.

A store outage of a minute must not fail a job, and must not make a task retry
redo a shard's inference: so every storage call (list, read, write, commit,
delete) is retried right here, with exponential backoff and full jitter, until
its total time budget is spent. Permanent errors (tasks/errors.py) are raised at
once, as a StorageError naming the operation and the object.

The budget is ``SHARDLINE_STORAGE_RETRY_SECONDS`` (default 300), read when a
call starts, so a worker's environment sets it.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import ErrorKind, JobError, PipelineError, classify, describe, redact, secret_values, storage_error

logger = logging.getLogger("shardline.tasks.storage")

T = TypeVar("T")
RETRY_SECONDS_ENV = "SHARDLINE_STORAGE_RETRY_SECONDS"
DEFAULT_RETRY_SECONDS = 300.0


@dataclass(frozen=True)
class StorageRetry:
    """How long and how often a storage call is retried.

    The n-th wait is uniform in [0, min(max_delay, base_delay * 2**(n-1))] (full
    jitter: many workers retrying one store do not retry in step), and no wait
    runs past ``total_seconds`` after the first attempt."""

    total_seconds: float = DEFAULT_RETRY_SECONDS
    base_delay: float = 0.5
    max_delay: float = 10.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1)))

    @classmethod
    def from_env(cls) -> StorageRetry:
        raw = os.environ.get(RETRY_SECONDS_ENV)
        if raw is None:
            return cls()
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if seconds < 0:
            raise JobError("check", RETRY_SECONDS_ENV, f"must be a number of seconds >= 0, got {raw!r}")
        return cls(total_seconds=seconds)


def retry_storage(call: Callable[[], T], operation: str, target: str, fs: Any = None,
                  policy: StorageRetry | None = None) -> T:
    """``call()``, retried on transient errors within the policy's time budget.

    Raises StorageError (StorageNotFound, StorageDenied for those cases) naming
    ``operation`` and ``target``, with any credential of ``fs``'s storage options
    or the environment redacted from the reason."""
    policy = policy or StorageRetry.from_env()
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except PipelineError:
            raise  # already classified and named (an inner call, a corrupt object)
        except Exception as exc:
            secrets = secret_values(getattr(fs, "storage_options", None), dict(os.environ))
            kind = classify(exc)
            elapsed = time.monotonic() - started
            if kind is not ErrorKind.TRANSIENT:
                raise storage_error(operation, target, exc, secrets, "not retried") from exc
            delay = policy.delay(attempt)
            if elapsed + delay > policy.total_seconds:
                note = f"still failing after {attempt} attempt(s) over {elapsed:.0f}s ({RETRY_SECONDS_ENV})"
                raise storage_error(operation, target, exc, secrets, note) from exc
            logger.warning("%s %s: %s; retry %d in %.1fs", operation, redact(target, secrets),
                           redact(describe(exc), secrets), attempt, delay)
            time.sleep(delay)
