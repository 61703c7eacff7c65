"""The batch_inference flow: every shard under a prefix through one model, in order.

Orchestration only: run the pre-flight checks (model, output, input: each fails in
seconds, tasks/preflight.py), skip shards whose manifest matches the job's
fingerprint, keep ``shards_in_flight`` shard tasks running (flows/shard_loop.py;
they share this process's engine, which streams their rows in one continuous
batch), settle the outcome of failed shards against their manifests, write the job's
usage as an OpenAI batch object (``<output>/_batch.json``), publish the artifacts and
return the summary. A shard that fails does not stop the others;
the flow then fails with ShardsFailed, whose ``summary`` covers every shard. A
stopped run (SIGTERM, a cancelled flow run) aborts its engine work and commits
nothing partial.

``execution`` picks where shard tasks run (this process's threads, or a Ray cluster,
flows/ray_scale_out.py) and the global concurrency limit their engine work holds.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound

from shardline.tasks.engine_cache import engines_held, get_executor
from shardline.tasks.errors import PipelineError, redact_url
from shardline.tasks.job import BatchJob
from shardline.tasks.outcomes import settle_failed
from shardline.tasks.prefect_tasks import completed_manifests_task, preflight_task
from shardline.tasks.progress import JobProgress, ThroughputLog
from shardline.tasks.progress_report import DEFAULT_INTERVAL_SECONDS, show_progress
from shardline.tasks.status import write_job_record
from shardline.tasks.storage import Shard
from shardline.tasks.summary import ShardsFailed, failure_message, job_summary, shard_entry
from shardline.tasks.usage import BATCH_OBJECT, write_batch_object

from .artifacts import ProgressArtifact, publish_summary
from .execution import Execution, TaskRunnerKind
from .ray_scale_out import ray_submitter
from .shard_loop import Submit, run_shards

_log = logging.getLogger(__name__)
HEARTBEAT_SECONDS = 1.0  # how often progress is checked when no row finishes
THROUGHPUT_SECONDS = 5.0  # between two points of the summary's throughput chart


class ConcurrencyLimitMissing(ValueError):
    """Execution.gpu_concurrency_limit names a global concurrency limit that does not exist."""


@flow(name="batch-inference", description="Run an LLM over every prompt shard under a prefix; "
      "write one ordered output shard per input shard, resumably.")
def batch_inference(
    job: BatchJob, execution: Execution = Execution(), reprocess_completed: bool = False,
    progress_interval: float = DEFAULT_INTERVAL_SECONDS,
) -> dict[str, Any]:
    """Run ``job``; return the summary (per-shard entries and totals).

    Args:
        job: what to run: input and output prefixes, model, sampling and engine options.
        execution: where shard tasks run (threads or a Ray cluster) and the GPU concurrency limit.
        reprocess_completed: rerun shards even when their manifest says they are done.
        progress_interval: seconds between progress lines in the log (rows, tokens/s, ETA, the
            engine's health); a terminal gets a bar instead.
    """
    if progress_interval <= 0:
        raise ValueError(f"progress_interval must be a positive number of seconds, got {progress_interval}")
    logger = get_run_logger()
    started, created_at = time.perf_counter(), time.time()
    logger.info("batch inference %s -> %s: model %s, task %s", redact_url(job.input), redact_url(job.output),
                job.model, job.task.value)
    if execution.gpu_concurrency_limit:
        _require_concurrency_limit(execution.gpu_concurrency_limit)
    shards = preflight_task(job, model_here=execution.task_runner != TaskRunnerKind.RAY)
    entries, todo = ([], shards) if reprocess_completed else _skip_done(shards, job)
    logger.info("%d shard(s): %d already done, %d to run", len(shards), len(entries), len(todo))
    _record_job(job, shards, created_at)
    progress = JobProgress(todo, shards_done_before=len(entries))
    with engines_held(), _engine_preloaded(job, execution, todo), _shard_submitter(execution) as submit, \
            _watched(progress, progress_interval) as throughput:
        entries += run_shards(todo, job, progress, submit, execution)
    entries = settle_failed(entries, shards, job)
    summary = job_summary(entries, time.perf_counter() - started, redact_url(job.output))
    summary["throughput"] = throughput.spans()
    try:  # the job's request counts and usage as an OpenAI batch object, <output>/_batch.json
        summary["batch"] = write_batch_object(job, summary, created_at)
    except PipelineError as exc:  # the shards are committed; a rerun skips them and writes it again
        logger.error("the job's %s was not written: %s", BATCH_OBJECT, exc)
    publish_summary(summary)
    if summary["totals"]["failed"]:
        raise ShardsFailed(failure_message(summary), summary)
    return summary


@contextlib.contextmanager
def _watched(progress: JobProgress, interval: float) -> Iterator[ThroughputLog]:
    """While the shards run: progress to the log (or a bar on a terminal) and to the progress
    artifact, also when no row finishes (a heartbeat); yields the throughput log the summary's
    chart is drawn from."""
    bar = show_progress(progress, get_run_logger(), sys.stderr, interval)
    ProgressArtifact(progress)
    throughput = ThroughputLog()
    progress.add_sink(throughput, THROUGHPUT_SECONDS)
    try:
        with progress.heartbeat(min(interval, HEARTBEAT_SECONDS)):
            yield throughput
    finally:
        if bar is not None:
            bar.close()


def _record_job(job: BatchJob, shards: list[Shard], created_at: float) -> None:
    """Write the job record ``shardline status`` reads; a failure costs only its list of missing shards."""
    try:
        write_job_record(job, shards, created_at)
    except PipelineError as exc:
        get_run_logger().warning("the job record was not written (shardline status will not list shards not "
                                 "committed yet): %s", exc)


@contextlib.contextmanager
def _shard_submitter(execution: Execution) -> Iterator[Submit]:
    """Shard tasks go to the flow's own task runner, or to a Ray cluster."""
    if execution.task_runner == TaskRunnerKind.RAY:
        with ray_submitter(execution) as submit:
            yield submit
    else:
        yield lambda task, parameters: task.submit(**parameters)


@contextlib.contextmanager
def _engine_preloaded(job: BatchJob, execution: Execution, todo: list[Shard]) -> Iterator[None]:
    """Load this process's engine in the background while the first shard tasks start
    and read their rows; their get_executor waits for this load instead of starting one.

    Only for shards that run in this process (not on Ray workers) and hold no GPU
    concurrency limit (the load would take GPU memory outside the limit). Errors are
    left to the shard tasks, which load again and report them per shard. The load is
    joined before the engines are released, so none outlives the flow's hold.
    """
    if not todo or execution.task_runner == TaskRunnerKind.RAY or execution.gpu_concurrency_limit:
        yield
        return

    def preload() -> None:
        try:
            get_executor(job.model, execution.engine_host, job.data_parallel_size, **job.engine_kwargs())
        except Exception:  # reported by the shard tasks' own load
            _log.debug("engine preload failed; shard tasks will load it", exc_info=True)

    loader = threading.Thread(target=preload, name="shardline-engine-preload", daemon=True)
    loader.start()
    try:
        yield
    finally:
        loader.join()


def _require_concurrency_limit(name: str) -> None:
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            raise ConcurrencyLimitMissing(
                f"global concurrency limit {name!r} does not exist; create it (prefect gcl create {name} "
                f"--limit N) or leave execution.gpu_concurrency_limit empty"
            ) from None


def _skip_done(shards: list[Shard], job: BatchJob) -> tuple[list[dict[str, Any]], list[Shard]]:
    """Entries for shards already done; the shards still to run."""
    entries, todo = [], []
    for shard, manifest in zip(shards, completed_manifests_task(shards, job)):
        if manifest is None:
            todo.append(shard)
        else:
            entries.append(shard_entry(shard.key, "skipped", manifest))
    return entries, todo
