"""Thin Prefect tasks over the plain shard functions; the only Prefect import in tasks/.

Retries: storage calls retry transient errors where they happen, for minutes
(tasks/retrying.py); a task is retried only for what that cannot cover, an engine
that failed to load or run (shard_job.task_may_retry). Permanent errors (a bad
shard, access denied, a missing bucket), a failed write (its engine results would
be recomputed) and a stopping run are final.
Caching is off: whether a shard is done is decided by its manifest, not by Prefect.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency

from . import preflight, shard_writer, storage
from .engine_cache import EngineHost
from .job import BatchJob
from .manifest import ShardManifest
from .progress import JobProgress
from .shard_job import ShardPipeline, task_may_retry

_RETRY_DELAYS: list[float] = [2, 10]
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


@task(name="check-shards-done", cache_policy=NO_CACHE, retries=2,
      retry_delay_seconds=_RETRY_DELAYS, retry_condition_fn=_retriable)
def completed_manifests_task(shards: list[storage.Shard], job: BatchJob) -> list[ShardManifest | None]:
    """Each shard's manifest when it is already done for ``job``, else None, in order.

    One task for all shards: a task run per shard costs the Prefect API more than the
    check itself (a few storage reads), and the flow's start waits on all of them."""
    if not shards:
        return []
    with ThreadPoolExecutor(max_workers=min(_CHECK_THREADS, len(shards))) as pool:
        return list(pool.map(lambda shard: shard_writer.completed_manifest(shard, job), shards))


@task(name="process-shard", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=_RETRY_DELAYS,
      retry_condition_fn=_retriable, task_run_name="shard-{shard.key}")
def process_shard_task(shard: storage.Shard, job: BatchJob, gpu_limit: str | None = None,
                       engine_host: EngineHost = EngineHost.THREAD,
                       progress: JobProgress | None = None) -> ShardManifest:
    """Read, run and write one shard on the engine ``engine_host`` names; return its manifest.
    ``progress`` (the flow's, when the task runs in its process) hears of its rows.

    With ``gpu_limit`` (a Prefect global concurrency limit's name) the shard holds
    one slot of it while it runs on the engine, so the limit caps shard tasks on
    GPUs across every run; reading and writing hold none."""
    engine_slot = functools.partial(_gpu_slot, gpu_limit) if gpu_limit else None
    return ShardPipeline(job, engine_host, engine_slot, progress).process(shard)


@contextlib.contextmanager
def _gpu_slot(limit: str, shard: storage.Shard) -> Iterator[None]:
    logger = get_run_logger()
    with concurrency(limit, occupy=1, strict=True):
        logger.info("shard %s holds a slot of %s", shard.key, limit)
        try:
            yield
        finally:
            logger.info("shard %s releases its slot of %s", shard.key, limit)
