"""``batch_usage``: the TaskFlow task that ends a job: its usage in ``_batch.json`` and XCom.

Each ShardInferenceOperator instance pushes its own shard's manifest (rows, errors,
prompt, completion and cached prompt tokens). This task, run after all of them
(``trigger_rule="all_done"``, so failed shards are counted too), sums the committed
manifests into the job summary, writes ``<output>/_batch.json`` (an OpenAI Batch
object: request counts and usage) and returns the totals and that object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow.sdk import get_current_context, task

from shardline.tasks import storage
from shardline.tasks.usage import write_batch_object

from .connection import get_storage_options
from .shard_batch import make_job


@task(trigger_rule="all_done")
def batch_usage(job: Mapping[str, Any], storage_conn_id: str | None = None) -> dict[str, Any]:
    """The job's totals (``totals``: shards done and failed, rows, errors, prompt, completion
    and cached prompt tokens) and its batch object (``batch``, also in ``<output>/_batch.json``)."""
    from shardline.tasks.outcomes import summary_from_manifests  # transformers: at run time only

    batch_job = make_job(job, get_storage_options(storage_conn_id))
    shards = storage.list_shards(batch_job.input, batch_job.storage(), batch_job.input_format.value,
                                 exclude=batch_job.output)
    summary = summary_from_manifests(shards, batch_job)
    dag_run = get_current_context().get("dag_run")
    started = getattr(dag_run, "start_date", None)
    created_at = started.timestamp() if started is not None else 0.0
    batch = write_batch_object(batch_job, summary, created_at)
    totals = {name: value for name, value in summary["totals"].items() if not name.endswith("per_second")
              and name != "wall_seconds"}
    return {"totals": totals, "batch": batch}
