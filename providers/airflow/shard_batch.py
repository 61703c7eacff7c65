"""The Airflow operator's work, as plain code: run a few shards of one job, abortably.

No Airflow here, only shardline.tasks' plain shard functions: the operator (and a
test) build a ShardBatch and call ``run``; Airflow's ``on_kill`` calls ``abort``.

Invariants:
- A shard whose manifest matches the job's fingerprint is skipped (its manifest is
  returned), so a cleared or backfilled task redoes only what is not done.
- The engine is never closed here. By default it is the host's shared engine
  service (tasks/engine_client.py): the first task instance on a worker starts it,
  later task instances (each a fresh process under Airflow 3) connect to it, and it
  retires after SHARDLINE_ENGINE_IDLE_TIMEOUT idle seconds. With
  ``engine_service=False`` it is this process's own, which only later work in the
  same process reuses.
- After ``abort`` no output is committed: the shard's rows leave the engine, its
  ``run_shard`` raises ShardAborted, and the check before ``write_shard`` catches an
  abort that came after the last row, or in the instant between handing the rows
  to ``run_shard`` and the runner taking them (those rows then run to their end).
  Outputs are committed atomically anyway, so a reader never sees a partial one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardline.tasks import engine_cache
from shardline.tasks.job import BatchJob
from shardline.tasks.engine_cache import EngineHost
from shardline.tasks.runner import ShardAborted
from shardline.tasks.shard_job import read_shard, run_shard, write_shard
from shardline.tasks.shard_writer import completed_manifest
from shardline.tasks.storage import Shard

logger = logging.getLogger("shardline.providers.airflow")


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


def make_job(fields: Mapping[str, Any], storage_options: dict[str, Any]) -> BatchJob:
    """The BatchJob of rendered ``fields`` plus the connection's storage options."""
    if not isinstance(fields, Mapping):
        raise TypeError(f"the job rendered to a {type(fields).__name__}, not BatchJob fields: {fields!r:.200}; "
                        "a whole-job template needs the DAG's render_template_as_native_obj=True")
    return BatchJob(**job_fields(fields), storage_options=storage_options)


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
        self.job = job
        self.engine_host = EngineHost.SERVICE if engine_service else EngineHost.THREAD
        self._aborted = threading.Event()
        self._lock = threading.RLock()  # reentrant: abort may run in a signal handler
        self._running: set[str] = set()  # shard keys handed to the runner
        self._runner: Any = None  # a ShardRunner, or a client of the engine service

    def run(self, shards: list[Shard]) -> list[dict[str, Any]]:
        """Each shard's manifest, in order; a failed shard raises after the others finish."""
        if len(shards) <= 1:
            return [self._run_one(shard) for shard in shards]  # in this thread: a signal reaches it
        with ThreadPoolExecutor(min(len(shards), self.job.shards_in_flight), "shardline-shard") as pool:
            futures = [pool.submit(self._run_one, shard) for shard in shards]
            return [future.result() for future in futures]

    def abort(self) -> None:
        """Stop every shard: abort the rows in the engine, commit no output."""
        self._aborted.set()
        with self._lock:
            keys, runner = sorted(self._running), self._runner
        for key in keys:
            if runner is not None and runner.abort_shard(key):
                logger.warning("shard %s aborted: its requests left the engine, no output written", key)

    def _run_one(self, shard: Shard) -> dict[str, Any]:
        done = completed_manifest(shard, self.job)
        if done is not None:
            logger.info("shard %s already done with this job's fingerprint: skipped", shard.key)
            return done
        prepared = read_shard(shard, self.job)
        if any(row.request is not None for row in prepared.rows):
            # the cached runner that run_shard uses; loaded outside the lock, which abort takes
            runner = engine_cache.get_runner(self.job.model, engine_host=self.engine_host,
                                             **self.job.engine_kwargs())
            with self._lock:
                self._runner = runner
        with self._lock:
            self._raise_if_aborted(shard)
            self._running.add(shard.key)
        try:
            run = run_shard(prepared, self.job, self.engine_host)
        finally:
            with self._lock:
                self._running.discard(shard.key)
        self._raise_if_aborted(shard)
        manifest = write_shard(run, self.job)
        logger.info("shard %s: %d rows, %d errors, %d completion tokens", shard.key,
                    manifest["rows"], manifest["errors"], manifest["completion_tokens"])
        return manifest

    def _raise_if_aborted(self, shard: Shard) -> None:
        if self._aborted.is_set():
            raise ShardAborted(f"shard {shard.key} was aborted; no output written")
