"""The batch_inference flow: every shard under a prefix through one model, in order.

Orchestration only: list the shards, skip those whose manifest matches the job's
fingerprint, keep ``shards_in_flight`` shard tasks running (they share this
process's engine, which streams their rows in one continuous batch), publish the
artifacts and return the summary. A shard that fails does not stop the others;
the flow then fails with ShardsFailed, whose ``summary`` covers every shard.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.futures import PrefectFuture, as_completed

from shardline.tasks.job import BatchJob
from shardline.tasks.prefect_tasks import close_engines_task, completed_manifest_task, list_shards_task, \
    process_shard_task
from shardline.tasks.shard_writer import redact_url
from shardline.tasks.storage import Shard
from shardline.tasks.summary import ShardsFailed, failure_message, job_summary, shard_entry

from .artifacts import ShardProgress, publish_summary


@flow(name="batch-inference", description="Run an LLM over every prompt shard under a prefix; "
      "write one ordered output shard per input shard, resumably.")
def batch_inference(job: BatchJob) -> dict[str, Any]:
    """Run ``job``; return the summary (per-shard entries and totals)."""
    logger = get_run_logger()
    started = time.perf_counter()
    logger.info("batch inference %s -> %s: model %s, task %s", redact_url(job.input), redact_url(job.output),
                job.model, job.task.value)
    shards = list_shards_task(job)
    entries, todo = _skip_done(shards, job)
    logger.info("%d shard(s): %d already done, %d to run", len(shards), len(entries), len(todo))
    progress = ShardProgress(total=len(shards), finished=len(entries))
    try:
        entries += _run_shards(todo, job, progress)
    finally:
        close_engines_task()
    summary = job_summary(entries, time.perf_counter() - started, redact_url(job.output))
    publish_summary(summary)
    if summary["totals"]["failed"]:
        raise ShardsFailed(failure_message(summary), summary)
    return summary


def _skip_done(shards: list[Shard], job: BatchJob) -> tuple[list[dict[str, Any]], list[Shard]]:
    """Entries for shards already done; the shards still to run."""
    checks = [(shard, completed_manifest_task.submit(shard, job)) for shard in shards]
    entries, todo = [], []
    for shard, check in checks:
        manifest = check.result()
        if manifest is None:
            todo.append(shard)
        else:
            entries.append(shard_entry(shard.key, "skipped", manifest))
    return entries, todo


def _run_shards(todo: list[Shard], job: BatchJob, progress: ShardProgress) -> list[dict[str, Any]]:
    """Run ``todo`` with at most ``job.shards_in_flight`` shard tasks at once."""
    logger = get_run_logger()
    waiting = collections.deque(todo)
    running: dict[int, tuple[PrefectFuture, Shard]] = {}
    entries = []
    while waiting or running:
        while waiting and len(running) < job.shards_in_flight:
            shard = waiting.popleft()
            future = process_shard_task.submit(shard, job)
            running[id(future)] = (future, shard)
        finished = next(as_completed([future for future, _ in running.values()]))
        future, shard = running.pop(id(finished))
        try:
            entries.append(shard_entry(shard.key, "done", future.result()))
            logger.info("shard %s done (%d of %d finished)", shard.key, progress.finished + 1, progress.total)
        except Exception as exc:  # the task failed for good; the other shards go on
            message = f"{type(exc).__name__}: {exc}"
            logger.error("shard %s failed: %s", shard.key, message)
            entries.append(shard_entry(shard.key, "failed", message=message))
        progress.advance()
    return entries
