"""The work on one shard, as plain functions: read, run, write, or all three.

Each is what a Prefect task (tasks/prefect_tasks.py) or an Airflow operator wraps.
``run_shard`` hands the shard's good rows to the engine through the engine cache's
ShardRunner, so shards running in other threads share one engine; ``engine_host``
says whether that engine runs in this process, a child process or the host's
shared engine service (tasks/engine_client.py).

Failures come out as the pipeline's typed errors (tasks/errors.py): reading and
writing raise StorageError or ShardError naming the object; the engine raises
EngineError naming the model (load) or the shard (run). Once the engine has
answered, only the write can fail, and it is retried in place (tasks/retrying.py),
never by running the shard again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .engine_cache import EngineHost, get_runner
from .errors import EngineError, ErrorKind, ModelUnusable, PipelineError, classify, describe
from .job import BatchJob
from .rows import PreparedShard, prepare_shard
from .runner import RowResult, RunnerError, ShardAborted
from .shard_reader import read_shard_records
from .shard_writer import write_shard_output
from .shutdown import raise_if_shutting_down, shutdown_reason
from .storage import Shard

logger = logging.getLogger("shardline.tasks.shard_job")


@dataclass
class ShardRun:
    """A shard after the engine: its rows, the engine's results by row index, timings."""

    prepared: PreparedShard
    results: dict[int, RowResult]
    seconds: dict[str, float] = field(default_factory=dict)


def read_shard(shard: Shard, job: BatchJob) -> PreparedShard:
    """Read and validate ``shard``; bad rows carry errors, an unreadable shard raises ShardError."""
    started = time.perf_counter()
    prepared = prepare_shard(read_shard_records(shard, job.storage()), job)
    prepared.read_seconds = round(time.perf_counter() - started, 4)
    return prepared


def run_shard(prepared: PreparedShard, job: BatchJob, engine_host: EngineHost = EngineHost.THREAD) -> ShardRun:
    """Run every valid row of ``prepared`` through the engine for ``job`` on ``engine_host``."""
    requests = [row.request for row in prepared.rows if row.request is not None]
    started = time.perf_counter()
    results: list[RowResult] = []
    if requests:
        runner = _load_runner(job, engine_host)
        try:
            results = runner.run_shard(prepared.key, requests)
        except ShardAborted:
            raise  # stopped on purpose: no output, no retry
        except (RunnerError, RuntimeError, MemoryError) as exc:  # the engine itself failed, not a row
            raise EngineError("run", f"shard {prepared.key} on model {job.model}", describe(exc)) from exc
    seconds = {"read": prepared.read_seconds, "run": round(time.perf_counter() - started, 4)}
    return ShardRun(prepared, {result.index: result for result in results}, seconds)


def _load_runner(job: BatchJob, engine_host: EngineHost) -> Any:
    """The engine's ShardRunner for ``job``; a failed load is an EngineError naming the model
    (a model that cannot be used at all is permanent: the pre-flight check should have said so)."""
    try:
        return get_runner(job.model, engine_host=engine_host, **job.engine_kwargs())
    except ShardAborted:
        raise
    except ValueError as exc:  # the engine's ModelLoadError: this model cannot run, retrying cannot help
        raise ModelUnusable("load", f"model {job.model}", describe(exc)) from exc
    except Exception as exc:  # out of memory, a device or service that failed: may pass on a retry
        raise EngineError("load", f"model {job.model}", describe(exc)) from exc


def write_shard(run: ShardRun, job: BatchJob) -> dict[str, Any]:
    """Commit the output shard and its manifest; return the manifest."""
    return write_shard_output(run.prepared, run.results, job, run.seconds)


def task_may_retry(exc: BaseException) -> bool:
    """Whether running a shard task again may fix ``exc``: an engine that failed to load or
    run (EngineError) or a transient error that escaped its own retries. Never a permanent
    error, a storage error (already retried for minutes where it happened; a write failing
    again would recompute the engine's results), an abort or a stopping run."""
    if shutdown_reason() is not None or isinstance(exc, ShardAborted):
        return False
    if isinstance(exc, PipelineError):
        return exc.task_retry
    return classify(exc) in (ErrorKind.TRANSIENT, ErrorKind.ENGINE)


def process_shard(shard: Shard, job: BatchJob, engine_host: EngineHost = EngineHost.THREAD) -> dict[str, Any]:
    """Read, run and write one shard; return its manifest."""
    raise_if_shutting_down(f"shard {shard.key}")
    run = run_shard(read_shard(shard, job), job, engine_host)
    manifest = write_shard(run, job)
    logger.info("shard %s: %d rows, %d errors, %d completion tokens", shard.key,
                manifest["rows"], manifest["errors"], manifest["completion_tokens"])
    return manifest
