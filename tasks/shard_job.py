"""The work on one shard, as plain functions: read, run, write, or all three.

Each is what a Prefect task (tasks/prefect_tasks.py) or an Airflow operator wraps.
``run_shard`` hands the shard's good rows to the engine through the engine cache's
ShardRunner, so shards running in other threads share one engine; ``engine_host``
says whether that engine runs in this process, a child process or the host's
shared engine service (tasks/engine_client.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .engine_cache import EngineHost, get_runner
from .job import BatchJob
from .rows import PreparedShard, prepare_shard
from .runner import RowResult
from .shard_reader import read_shard_records
from .shard_writer import write_shard_output
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
        runner = get_runner(job.model, engine_host=engine_host, **job.engine_kwargs())
        results = runner.run_shard(prepared.key, requests)
    seconds = {"read": prepared.read_seconds, "run": round(time.perf_counter() - started, 4)}
    return ShardRun(prepared, {result.index: result for result in results}, seconds)


def write_shard(run: ShardRun, job: BatchJob) -> dict[str, Any]:
    """Commit the output shard and its manifest; return the manifest."""
    return write_shard_output(run.prepared, run.results, job, run.seconds)


def process_shard(shard: Shard, job: BatchJob, engine_host: EngineHost = EngineHost.THREAD) -> dict[str, Any]:
    """Read, run and write one shard; return its manifest."""
    manifest = write_shard(run_shard(read_shard(shard, job), job, engine_host), job)
    logger.info("shard %s: %d rows, %d errors, %d completion tokens", shard.key,
                manifest["rows"], manifest["errors"], manifest["completion_tokens"])
    return manifest
