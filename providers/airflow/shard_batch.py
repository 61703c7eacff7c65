"""The Airflow operator's work, as plain code: run a few shards of one job, abortably.

No Airflow here: the operator (and a test) build a ShardBatch and call ``run``;
Airflow's ``on_kill`` calls ``abort``. Each shard goes through the same
ShardPipeline as a Prefect shard task (tasks/shard_job.py), so after ``abort`` no
output is committed.

Invariants:
- A shard whose manifest matches the job's fingerprint is skipped (its manifest is
  returned), so a cleared or backfilled task redoes only what is not done.
- The engine is never closed here. By default it is the host's shared engine
  service (tasks/engine_client.py): the first task instance on a worker starts it,
  later task instances (each a fresh process under Airflow 3) connect to it, and it
  retires after SHARDLINE_ENGINE_IDLE_TIMEOUT idle seconds. With
  ``engine_service=False`` it is this process's own, which only later work in the
  same process reuses.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from shardline.tasks.job import BatchJob
from shardline.tasks.manifest import ShardManifest
from shardline.tasks.progress import JobProgress
from shardline.tasks.progress_report import DEFAULT_INTERVAL_SECONDS, log_sink
from shardline.tasks.storage import Shard

if TYPE_CHECKING:
    from shardline.tasks.shard_job import ShardPipeline


class CredentialsInDagError(ValueError):
    """Storage credentials written into DAG code instead of an Airflow connection."""


def job_fields(job: BatchJob | Mapping[str, Any]) -> dict[str, Any]:
    """BatchJob fields as DAG code may hold them: JSON-ready, templatable, no credentials.

    Validation waits for ``make_job`` at run time, after Airflow renders templates
    (``"input": "s3://bucket/prompts/{{ ds }}"``)."""
    if isinstance(job, BatchJob):
        if job.storage():
            raise CredentialsInDagError(
                "this BatchJob carries storage_options; leave them out and name an Airflow connection "
                "(storage_conn_id) instead")
        return job.public_fields()
    fields = dict(job)
    if "storage_options" in fields:
        raise CredentialsInDagError(
            "job field 'storage_options' is not accepted in DAG code; put the credentials in an Airflow "
            "connection and pass its id as storage_conn_id")
    return fields


def make_job(fields: object, storage_options: dict[str, Any]) -> BatchJob:
    """The BatchJob of rendered ``fields`` plus the connection's storage options; TypeError
    when the job's template rendered to anything but a mapping of fields."""
    if not isinstance(fields, Mapping):
        raise TypeError(f"the job rendered to a {type(fields).__name__}, not BatchJob fields: {fields!r:.200}; "
                        "a whole-job template needs the DAG's render_template_as_native_obj=True")
    return BatchJob.model_validate({**job_fields(fields), "storage_options": storage_options})


def shard_to_xcom(shard: Shard) -> dict[str, Any]:
    """A shard as a small JSON object (what the listing task returns and .expand maps over)."""
    return {"uri": shard.uri, "key": shard.key, "format": shard.format, "size": shard.size}


def shard_from_xcom(value: Shard | Mapping[str, Any]) -> Shard:
    if isinstance(value, Shard):
        return value
    missing = {"uri", "key", "format", "size"} - set(value)
    if missing:
        raise ValueError(f"a shard needs uri, key, format and size; {dict(value)!r} lacks {sorted(missing)}")
    return Shard(uri=value["uri"], key=value["key"], format=value["format"], size=int(value["size"]))


class ShardBatch:
    """Runs shards of one job in this process, ``job.shards_in_flight`` at a time, so
    their rows share one continuous batch; ``abort`` (any thread) stops them."""

    def __init__(self, job: BatchJob, engine_service: bool = True) -> None:
        # The engine's modules (torch, transformers) load when a task runs, not when the
        # scheduler parses a DAG file that names the operator.
        from shardline.tasks.engine_cache import EngineHost
        from shardline.tasks.shard_job import ShardPipeline

        self.job = job
        self._pipeline: ShardPipeline = ShardPipeline(job, EngineHost.SERVICE if engine_service else EngineHost.THREAD)

    def run(self, shards: list[Shard], log: logging.Logger | logging.LoggerAdapter[Any] | None = None,
            progress_interval: float = DEFAULT_INTERVAL_SECONDS) -> list[ShardManifest]:
        """Each shard's manifest, in order; a failed shard raises after the others finish.
        With ``log`` (the task's log), a progress line every ``progress_interval`` seconds:
        rows, errors, tokens/s, ETA and the engine's health."""
        progress = self._pipeline.progress = JobProgress(shards)
        if log is not None:
            progress.add_sink(log_sink(log), progress_interval)
        with progress.heartbeat(min(progress_interval, 1.0)):
            if len(shards) <= 1:  # in this thread: a signal reaches it
                return [self._process(shard) for shard in shards]
            with ThreadPoolExecutor(min(len(shards), self.job.shards_in_flight), "shardline-shard") as pool:
                futures = [pool.submit(self._process, shard) for shard in shards]
                return [future.result() for future in futures]

    def _process(self, shard: Shard) -> ShardManifest:
        progress = self._pipeline.progress
        assert progress is not None, "run() sets the batch's progress"
        try:
            manifest = self._pipeline.process(shard, skip_done=True)
        except BaseException:
            progress.shard_finished(shard.key, None)
            raise
        progress.shard_finished(shard.key, manifest, ran=progress.was_read(shard.key))
        return manifest

    def abort(self) -> None:
        """Stop every shard: abort the rows in the engine, commit no output."""
        self._pipeline.abort()
