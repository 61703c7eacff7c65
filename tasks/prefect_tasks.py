"""Thin Prefect tasks over the plain shard functions; the only Prefect import in tasks/.

Retries: storage calls retry transient errors where they happen, for minutes
(tasks/retrying.py); a task is retried only for what that cannot cover, an engine
that failed to load or run (shard_job.task_may_retry). Permanent errors (a bad
shard, access denied, a missing bucket), a failed write (its engine results would
be recomputed) and a stopping run are final.
Caching is off: whether a shard is done is decided by its manifest, not by Prefect.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency

from . import engine_cache, preflight, shard_job, shard_writer, storage
from .job import BatchJob
from .shard_job import task_may_retry
from .shutdown import raise_if_shutting_down

_RETRY_DELAYS = [2, 10]
# Manifest checks in flight at once (storage round trips, mostly waiting).
_CHECK_THREADS = 16


def _retriable(task_obj: Any, task_run: Any, state: Any) -> bool:
    """Retry only a failure that running the task again may fix (shard_job.task_may_retry)."""
    try:
        state.result()
    except Exception as exc:
        return task_may_retry(exc)
    return True


@task(name="preflight", cache_policy=NO_CACHE)
def preflight_task(job: BatchJob, model_here: bool = True) -> list[storage.Shard]:
    """The pre-flight checks (model, output, input); the input's shards. Never retried:
    what it finds is permanent, and transient storage errors are retried inside."""
    return preflight.preflight(job, model_here=model_here)


@task(name="list-shards", cache_policy=NO_CACHE, retries=2,
      retry_delay_seconds=_RETRY_DELAYS, retry_condition_fn=_retriable)
def list_shards_task(job: BatchJob) -> list[storage.Shard]:
    """Every input shard of ``job``, sorted by key (outputs excluded)."""
    return storage.list_shards(job.input, job.storage(), job.input_format.value, exclude=job.output)


@task(name="check-shard-done", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=_RETRY_DELAYS,
      retry_condition_fn=_retriable, task_run_name="check-{shard.key}")
def completed_manifest_task(shard: storage.Shard, job: BatchJob) -> dict[str, Any] | None:
    """The shard's manifest when it is already done for ``job``, else None."""
    return shard_writer.completed_manifest(shard, job)


@task(name="check-shards-done", cache_policy=NO_CACHE, retries=2,
      retry_delay_seconds=_RETRY_DELAYS, retry_condition_fn=_retriable)
def completed_manifests_task(shards: list[storage.Shard], job: BatchJob) -> list[dict[str, Any] | None]:
    """Each shard's manifest when it is already done for ``job``, else None, in order.

    One task for all shards: a task run per shard costs the Prefect API more than the
    check itself (a few storage reads), and the flow's start waits on all of them."""
    if not shards:
        return []
    with ThreadPoolExecutor(max_workers=min(_CHECK_THREADS, len(shards))) as pool:
        return list(pool.map(lambda shard: shard_writer.completed_manifest(shard, job), shards))


@task(name="read-shard", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=_RETRY_DELAYS,
      retry_condition_fn=_retriable, task_run_name="read-{shard.key}")
def read_shard_task(shard: storage.Shard, job: BatchJob) -> shard_job.PreparedShard:
    return shard_job.read_shard(shard, job)


@task(name="run-shard", cache_policy=NO_CACHE, retries=1,
      retry_delay_seconds=_RETRY_DELAYS, retry_condition_fn=_retriable)
def run_shard_task(prepared: shard_job.PreparedShard, job: BatchJob) -> shard_job.ShardRun:
    return shard_job.run_shard(prepared, job)


@task(name="write-shard", cache_policy=NO_CACHE, retries=2,
      retry_delay_seconds=_RETRY_DELAYS, retry_condition_fn=_retriable)
def write_shard_task(run: shard_job.ShardRun, job: BatchJob) -> dict[str, Any]:
    return shard_job.write_shard(run, job)


@task(name="process-shard", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=_RETRY_DELAYS,
      retry_condition_fn=_retriable, task_run_name="shard-{shard.key}")
def process_shard_task(shard: storage.Shard, job: BatchJob, gpu_limit: str | None = None,
                       engine_host: engine_cache.EngineHost = engine_cache.EngineHost.THREAD) -> dict[str, Any]:
    """Read, run and write one shard on the engine ``engine_host`` names; return its manifest.

    With ``gpu_limit`` (a Prefect global concurrency limit's name) the shard holds
    one slot of it while it runs on the engine, so the limit caps shard tasks on
    GPUs across every run; reading and writing hold none."""
    raise_if_shutting_down(f"shard {shard.key}")
    if gpu_limit is None:
        return shard_job.process_shard(shard, job, engine_host)
    prepared = shard_job.read_shard(shard, job)
    logger = get_run_logger()
    with concurrency(gpu_limit, occupy=1, strict=True):
        logger.info("shard %s holds a slot of %s", shard.key, gpu_limit)
        try:
            run = shard_job.run_shard(prepared, job, engine_host)
        finally:
            logger.info("shard %s releases its slot of %s", shard.key, gpu_limit)
    return shard_job.write_shard(run, job)


@task(name="close-engines", cache_policy=NO_CACHE)
def close_engines_task() -> int:
    """Free this process's engines."""
    return engine_cache.close_engines()
