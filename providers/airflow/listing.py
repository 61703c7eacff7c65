"""``list_shards``: the TaskFlow task whose result ShardInferenceOperator is mapped over."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from airflow.sdk import get_current_context, task

from shardline.tasks import storage
from shardline.tasks.errors import PipelineError
from shardline.tasks.job import BatchJob
from shardline.tasks.status import write_job_record

from .connection import get_storage_options
from .shard_batch import make_job, shard_to_xcom

logger = logging.getLogger("shardline.providers.airflow.listing")


@task
def list_shards(
    job: Mapping[str, Any], storage_conn_id: str | None = None, shards_per_task: int = 1
) -> list[dict[str, Any]] | list[list[dict[str, Any]]]:
    """Every input shard of ``job`` (outputs excluded), sorted by key, as small JSON objects.

    With ``shards_per_task`` above 1 the shards come in groups of that many, one per
    mapped task instance: each instance streams its group through one continuous
    batch, and fewer instances stay under Airflow's ``max_map_length``. Shards already
    done are listed too (the operator skips them), so map indexes stay tied to the same
    shards across reruns.
    """
    if shards_per_task < 1:
        raise ValueError(f"shards_per_task must be 1 or more, not {shards_per_task}")
    batch_job = make_job(job, get_storage_options(storage_conn_id))
    listed = storage.list_shards(batch_job.input, batch_job.storage(), batch_job.input_format.value,
                                 exclude=batch_job.output)
    _record_job(batch_job, listed)
    shards = [shard_to_xcom(shard) for shard in listed]
    if shards_per_task == 1:
        return shards
    return [shards[start:start + shards_per_task] for start in range(0, len(shards), shards_per_task)]


def _record_job(job: BatchJob, shards: list[storage.Shard]) -> None:
    """The job record ``shardline status`` reads (``<output>/_job.json``), started at the DAG
    run's start as ``batch_usage``'s batch object is; a failure costs only its list of the
    shards not committed yet."""
    started = getattr(get_current_context().get("dag_run"), "start_date", None)
    try:
        write_job_record(job, shards, started.timestamp() if started is not None else 0.0)
    except PipelineError as exc:
        logger.warning("the job record was not written (shardline status will not list shards not "
                       "committed yet): %s", exc)
