"""Stopping a run cleanly: the per-process shutdown flag.

Set when ``shardline run`` gets SIGTERM or SIGINT, or when a flow run is stopped
(Prefect raises its TerminationSignal in the flow when a run is cancelled from
the UI, or the process is terminated). Deliberate per-process state, like the
engine cache it acts on:

- once set, no shard starts, no engine loads and no shard task is retried;
- ``engine_cache.request_shutdown`` sets it and aborts every request in every
  cached engine at once, so each running shard's ``run_shard`` raises
  ShardAborted, and a shard whose rows had all finished is not written either
  (the pipeline checks the flag before writing, tasks/shard_job.py);
- shards already writing finish their (atomic) commit, so what was computed and
  written is kept, and a rerun skips it;
- the flag is cleared when the last flow run in the process has closed its
  engines (engine_cache.engines_held), so a later run in a long-lived process
  (a test session, a worker) starts afresh.

Setting the flag may happen in a signal handler: it takes no lock.
"""

from __future__ import annotations

import threading

from .executor import ShardAborted

_REQUESTED = threading.Event()
_REASON: list[str] = []  # why, as set by the first request


class ShutdownRequested(ShardAborted):
    """The run is stopping (a signal, a cancelled flow run): this shard was not run, or was aborted."""


def mark_shutdown(reason: str) -> None:
    """Set the flag (the first reason is kept); engine_cache.request_shutdown also aborts
    the engines' work."""
    if not _REQUESTED.is_set():
        _REASON[:] = [reason]
        _REQUESTED.set()


def shutdown_reason() -> str | None:
    """Why the run is stopping, or None while it is not."""
    return _REASON[0] if _REQUESTED.is_set() and _REASON else None


def raise_if_shutting_down(what: str) -> None:
    """Raise ShutdownRequested, saying ``what`` did not start, when the run is stopping."""
    reason = shutdown_reason()
    if reason is not None:
        raise ShutdownRequested(f"{what} not started: the run is stopping ({reason}); a rerun resumes it")


def clear_shutdown() -> None:
    """Forget a shutdown (the engines it stopped are closed)."""
    _REQUESTED.clear()
    _REASON.clear()
