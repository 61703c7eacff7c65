"""The shard pipeline: read, run and write one shard, abortably; the one place a shard is processed.

The Prefect shard task (tasks/prefect_tasks.py) and the Airflow operator
(providers/airflow/shard_batch.py) both run shards through a ShardPipeline. It
hands a shard's good rows to the ShardExecutor of the job's engine configuration
on the chosen engine host (tasks/engine_cache.py), so shards running in other
threads share one engine.

Invariants:
- After ``abort()`` or a shutdown of the run (tasks/shutdown.py), no shard starts
  and no output is committed: a running shard's rows leave the engine and its
  ``run_shard`` raises ShardAborted, and the check before writing catches a stop
  that came after its last row, or in the instant between handing the rows over
  and the executor taking them (those rows then run to their end, unwritten).
  Outputs are committed atomically anyway, so a reader never sees a partial one.
- The executor is never closed here: the engine cache owns it.

Failures come out as the pipeline's typed errors (tasks/errors.py): reading and
writing raise StorageError or ShardError naming the object; the engine raises
EngineError naming the model (load) or the shard (run). Once the engine has
answered, only the write can fail, and it is retried in place (tasks/retrying.py),
never by running the shard again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from .engine_cache import EngineHost, get_executor
from .errors import EngineError, ErrorKind, ModelUnusable, PipelineError, classify, describe
from .executor import RowResult, RunnerError, ShardAborted, ShardExecutor
from .image_feed import ImageFeed
from .job import BatchJob
from .manifest import ShardManifest
from .openai_requests import is_openai_batch, prepare_openai_shard
from .progress import JobProgress
from .rows import PreparedShard, prepare_shard
from .shard_reader import read_shard_records
from .shard_writer import completed_manifest, write_shard_output
from .shutdown import raise_if_shutting_down, shutdown_reason
from .storage import Shard

logger = logging.getLogger("shardline.tasks.shard_job")

# engine_slot(shard): held while the shard's rows are on the engine (a GPU concurrency slot)
EngineSlot = Callable[[Shard], AbstractContextManager[Any]]


@dataclass
class ShardRun:
    """A shard after the engine: its rows, the engine's results by row index, timings."""

    prepared: PreparedShard
    results: dict[int, RowResult]
    seconds: dict[str, float] = field(default_factory=dict)


def read_shard(shard: Shard, job: BatchJob) -> PreparedShard:
    """Read and validate ``shard``; bad rows carry errors, an unreadable shard raises ShardError."""
    started = time.perf_counter()
    raw = read_shard_records(shard, job.storage())
    prepared = prepare_openai_shard(raw, job) if is_openai_batch(raw, job) else prepare_shard(raw, job)
    prepared.read_seconds = round(time.perf_counter() - started, 4)
    return prepared


def write_shard(run: ShardRun, job: BatchJob) -> ShardManifest:
    """Commit the output shard and its manifest; return the manifest."""
    return write_shard_output(run.prepared, run.results, job, run.seconds)


class ShardPipeline:
    """Processes shards of one job on one engine host, from any number of threads at
    once; ``abort`` (any thread, or a signal handler) stops every one of them."""

    def __init__(self, job: BatchJob, engine_host: EngineHost = EngineHost.THREAD,
                 engine_slot: EngineSlot | None = None, progress: JobProgress | None = None) -> None:
        self.job = job
        self.progress = progress  # told of each shard's rows as they are read and finish
        self.engine_host = EngineHost(engine_host)
        self._engine_slot = engine_slot
        self._aborted = threading.Event()
        self._lock = threading.RLock()  # reentrant: abort may run in a signal handler
        self._running: dict[str, ShardExecutor] = {}  # shard key -> the executor running its rows

    def process(self, shard: Shard, skip_done: bool = False) -> ShardManifest:
        """Read, run and write ``shard``; its manifest. With ``skip_done``, a shard whose
        manifest matches the job's fingerprint is not run again (its manifest is returned)."""
        self._raise_if_stopped(f"shard {shard.key}")
        if skip_done:
            done = completed_manifest(shard, self.job)
            if done is not None:
                logger.info("shard %s already done with this job's fingerprint: skipped", shard.key)
                return done
        prepared = read_shard(shard, self.job)
        if self.progress is not None:  # a row refused here is done (an error); others count per request
            counts = [len(row.engine_requests()) for row in prepared.rows]
            refused = counts.count(0)
            self.progress.shard_read(shard.key, sum(counts) + refused, errors=refused)
        with self._engine_slot(shard) if self._engine_slot else contextlib.nullcontext():
            run = self._run(prepared)
        self._raise_if_stopped(f"the write of shard {shard.key}")
        manifest = write_shard(run, self.job)
        logger.info("shard %s: %d rows, %d errors, %d completion tokens", shard.key,
                    manifest.rows, manifest.errors, manifest.completion_tokens)
        return manifest

    def abort(self) -> None:
        """Stop every shard: abort their rows in the engine, commit no output."""
        self._aborted.set()
        with self._lock:
            running = sorted(self._running.items())
        for key, executor in running:
            if executor.abort_shard(key):
                logger.warning("shard %s aborted: its requests left the engine, no output written", key)

    def _run(self, prepared: PreparedShard) -> ShardRun:
        """Every valid row of ``prepared`` through the engine."""
        requests = [request for row in prepared.rows for request in row.engine_requests()]
        started = time.perf_counter()
        results: list[RowResult] = []
        if requests:
            executor = self._load_executor()  # outside the lock, which abort takes
            if self.progress is not None:
                self.progress.watch_engine(executor.engine_reading)
            if any(request.images for request in requests):  # read ahead of the engine, memory bounded
                executor = ImageFeed(executor, self.job.images, self.job.storage())
            with self._lock:
                self._raise_if_stopped(f"shard {prepared.key}")
                self._running[prepared.key] = executor
            try:
                on_row = self.progress.on_row(prepared.key) if self.progress is not None else None
                results = executor.run_shard(prepared.key, requests, on_row=on_row)
            except ShardAborted:
                raise  # stopped on purpose: no output, no retry
            except (RunnerError, RuntimeError, MemoryError) as exc:  # the engine itself failed, not a row
                raise EngineError("run", f"shard {prepared.key} on model {self.job.model}", describe(exc)) from exc
            finally:
                with self._lock:
                    self._running.pop(prepared.key, None)
        seconds = {"read": prepared.read_seconds, "run": round(time.perf_counter() - started, 4)}
        return ShardRun(prepared, {result.index: result for result in results}, seconds)

    def _load_executor(self) -> ShardExecutor:
        """The job's ShardExecutor; a failed load is an EngineError naming the model (a model
        that cannot be used at all is permanent: the pre-flight check should have said so)."""
        job = self.job
        try:
            return get_executor(job.model, self.engine_host, job.data_parallel_size, **job.engine_kwargs())
        except ShardAborted:
            raise
        except ValueError as exc:  # the engine's ModelLoadError: this model cannot run, retrying cannot help
            raise ModelUnusable("load", f"model {job.model}", describe(exc)) from exc
        except Exception as exc:  # out of memory, a device or service that failed: may pass on a retry
            raise EngineError("load", f"model {job.model}", describe(exc)) from exc

    def _raise_if_stopped(self, what: str) -> None:
        """Raise ShardAborted (ShutdownRequested for a stopping run) saying ``what`` did not start."""
        raise_if_shutting_down(what)
        if self._aborted.is_set():
            raise ShardAborted(f"{what} not started: it was aborted; no output written")


def process_shard(shard: Shard, job: BatchJob, engine_host: EngineHost = EngineHost.THREAD) -> ShardManifest:
    """Read, run and write one shard; return its manifest."""
    return ShardPipeline(job, engine_host).process(shard)


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
