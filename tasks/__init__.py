"""Shard-level work as plain functions (no Prefect), plus thin Prefect task wrappers.

The plain functions (storage, shard_reader, rows, media, image_feed, executor, runner,
engine_cache, shard_writer, shard_job, summary) import no Prefect, so an Airflow operator can
reuse them; ``shardline.tasks.prefect_tasks`` wraps them as Prefect tasks and is the
only module here that imports Prefect. One shard is processed in one place, the
ShardPipeline of shard_job.
"""

from .job import BatchJob, InputFormat, JobTask, PoolingDefaults, SamplingDefaults
from .media import ImageOptions
from .shard_job import ShardPipeline, ShardRun, process_shard, read_shard, write_shard
from .shard_writer import completed_manifest, shard_is_done
from .storage import Shard, list_shards

__all__ = [
    "BatchJob", "ImageOptions", "InputFormat", "JobTask", "PoolingDefaults", "SamplingDefaults", "Shard",
    "ShardPipeline", "ShardRun", "completed_manifest", "list_shards", "process_shard", "read_shard", "shard_is_done",
    "write_shard",
]
