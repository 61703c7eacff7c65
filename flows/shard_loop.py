"""Keeping ``shards_in_flight`` shard tasks running, and stopping them cleanly.

Orchestration only. A shard task that fails does not stop the others. When the
run is stopped (the process got SIGTERM or SIGINT, or Prefect cancelled the flow
run and raised its TerminationSignal here), the loop asks every engine to abort
(tasks/shutdown.py): running shards leave the engine and write nothing, shards
already writing finish their atomic commit, waiting shards never start. It waits
a few seconds for the running tasks to come back so their outcomes are reported,
then lets the interruption go on.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger
from prefect.futures import PrefectFuture, as_completed

from shardline.tasks.engine_cache import request_shutdown
from shardline.tasks.errors import PipelineError, describe
from shardline.tasks.job import BatchJob
from shardline.tasks.prefect_tasks import process_shard_task
from shardline.tasks.progress import JobProgress
from shardline.tasks.shutdown import shutdown_reason
from shardline.tasks.storage import Shard
from shardline.tasks.summary import shard_entry

from .execution import Execution, TaskRunnerKind

# submit(task, parameters) -> future: how a shard task reaches its task runner.
Submit = Callable[[Any, dict[str, Any]], PrefectFuture]
DRAIN_SECONDS = 10.0  # how long a stopping run waits for its running shard tasks


class JobInterrupted(RuntimeError):
    """The run was stopped before every shard ran; ``entries`` are the shards that ended."""

    def __init__(self, message: str, entries: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.entries = entries

    def __reduce__(self) -> tuple[Any, ...]:
        return (JobInterrupted, (self.args[0], self.entries))


def run_shards(todo: list[Shard], job: BatchJob, progress: JobProgress, submit: Submit,
               execution: Execution) -> list[dict[str, Any]]:
    """Run ``todo`` with at most ``job.shards_in_flight`` shard tasks at once; one entry each.
    Shard tasks in this process report their rows to ``progress``; on Ray workers (other
    processes) a shard counts when its task ends."""
    waiting = collections.deque(todo)
    rows_progress = None if execution.task_runner == TaskRunnerKind.RAY else progress
    running: dict[int, tuple[PrefectFuture, Shard]] = {}
    entries: list[dict[str, Any]] = []
    try:
        while (waiting and shutdown_reason() is None) or running:
            while waiting and shutdown_reason() is None and len(running) < job.shards_in_flight:
                shard = waiting.popleft()
                future = submit(process_shard_task, {"shard": shard, "job": job, "gpu_limit":
                                                     execution.gpu_concurrency_limit,
                                                     "engine_host": execution.engine_host,
                                                     "progress": rows_progress})
                running[id(future)] = (future, shard)
            finished = next(as_completed([future for future, _ in running.values()]))
            entries.append(_entry(*running.pop(id(finished)), progress))
    except BaseException as exc:  # TerminationSignal (SIGTERM, a cancelled run), KeyboardInterrupt
        request_shutdown(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        entries += _drain(running, progress)
        raise
    reason = shutdown_reason()
    if reason is not None and waiting:
        raise JobInterrupted(f"the run was stopped ({reason}) with {len(waiting)} shard(s) not started; "
                             "committed shards are kept and a rerun resumes", entries)
    return entries


def _entry(future: PrefectFuture, shard: Shard, progress: JobProgress) -> dict[str, Any]:
    logger = get_run_logger()
    try:
        manifest = future.result()
    except Exception as exc:  # the task failed for good; the other shards go on
        message = str(exc) if isinstance(exc, PipelineError) else describe(exc)
        logger.error("shard %s failed: %s", shard.key, message)
        progress.shard_finished(shard.key, None)
        return shard_entry(shard.key, "failed", message=message)
    progress.shard_finished(shard.key, manifest)
    snapshot = progress.snapshot()
    logger.info("shard %s done (%d of %d finished)", shard.key, snapshot.shards_finished, snapshot.shards_total)
    return shard_entry(shard.key, "done", manifest)


def _drain(running: dict[int, tuple[PrefectFuture, Shard]], progress: JobProgress) -> list[dict[str, Any]]:
    """Wait up to DRAIN_SECONDS for the running shard tasks (aborted, or committing)."""
    deadline = time.monotonic() + DRAIN_SECONDS
    entries = []
    for future, shard in list(running.values()):
        try:
            future.wait(timeout=max(0.0, deadline - time.monotonic()))
        except (Exception, concurrent.futures.CancelledError):
            pass
        if future.state.is_final():
            entries.append(_entry(future, shard, progress))
    return entries
