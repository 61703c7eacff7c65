"""Shard-level work as plain functions (no Prefect), plus thin Prefect task wrappers.

The plain functions (storage, shard_reader, rows, media, image_feed, executor, runner,
engine_cache, shard_writer, shard_job, summary) import no Prefect, so an Airflow operator can
reuse them; ``shardline.tasks.prefect_tasks`` wraps them as Prefect tasks and is the
only module here that imports Prefect. One shard is processed in one place, the
ShardPipeline of shard_job.

Names are resolved on first use, so importing a light submodule (the job's fields, the
errors, the storage listing: what an Airflow DAG file needs when the scheduler parses it)
does not import the engine, torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names __getattr__ resolves, for type checkers
    from shardline.tasks.job import BatchJob, InputFormat, JobTask, PoolingDefaults, SamplingDefaults
    from shardline.tasks.media import ImageOptions
    from shardline.tasks.shard_job import ShardPipeline, ShardRun, process_shard, read_shard, write_shard
    from shardline.tasks.shard_writer import completed_manifest, shard_is_done
    from shardline.tasks.storage import Shard, list_shards

_EXPORTS = {
    "BatchJob": "job", "InputFormat": "job", "JobTask": "job", "PoolingDefaults": "job", "SamplingDefaults": "job",
    "ImageOptions": "media",
    "ShardPipeline": "shard_job", "ShardRun": "shard_job", "process_shard": "shard_job", "read_shard": "shard_job",
    "write_shard": "shard_job",
    "completed_manifest": "shard_writer", "shard_is_done": "shard_writer",
    "Shard": "storage", "list_shards": "storage",
}

# _EXPORTS' names, sorted (a literal, so type checkers read it).
__all__ = [
    "BatchJob", "ImageOptions", "InputFormat", "JobTask", "PoolingDefaults", "SamplingDefaults", "Shard",
    "ShardPipeline", "ShardRun", "completed_manifest", "list_shards", "process_shard", "read_shard", "shard_is_done",
    "write_shard",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardline.tasks' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
