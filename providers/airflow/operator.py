"""ShardInferenceOperator: one mapped task instance runs one shard (or a few) of a job.

Same parameters (BatchJob fields) and output contract (``<output>/<key>.parquet``
and ``<output>/_manifests/<key>.json``) as the Prefect ``batch_inference`` flow; the
work itself is ShardBatch over shardline.tasks' plain shard functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from shardline.tasks.errors import PipelineError
from shardline.tasks.job import BatchJob
from shardline.tasks.progress_report import DEFAULT_INTERVAL_SECONDS

from .connection import get_storage_options
from .shard_batch import ShardBatch, job_fields, make_job, shard_from_xcom

ShardValue = Mapping[str, Any]


class ShardInferenceOperator(BaseOperator):
    """Run ``job`` over ``shards``; push each shard's manifest to XCom (never outputs).

    :param job: BatchJob fields (or a BatchJob without storage_options); templated, so
        ``"input": "s3://bucket/prompts/{{ ds }}"`` makes a backfill run per partition. A
        template of the whole job (``"{{ params.job }}"``) needs the DAG's
        ``render_template_as_native_obj=True``. Rows with images take ``"images"``
        (``{"column": ..., "allowed_domains": [...], "max_image_bytes": ...}``); their
        images are read with the connection's storage options, like the shards. OpenAI
        requests that offer tools have their calls read by ``"tool_call_parser"`` (vLLM's
        names; none takes the one the model's chat template implies). ``"data_parallel_size": N``
        runs N engine replicas in the engine service (or this process), one per GPU (group),
        fed from one queue of rows: several GPUs on one worker without Ray.
        ``"tensor_parallel_size": N`` splits the model over N GPUs (one process per rank,
        started by the engine): a model larger than one GPU.
    :param shards: one shard or a list, as ``list_shards`` returns them (map with ``.expand``).
    :param storage_conn_id: Airflow connection holding the storage credentials (an AWS-style
        connection: login, password, extra.endpoint_url); none for local paths.
    :param engine_service: run the shards on the worker host's shared engine service (the
        default): the first task instance on a host starts it, later ones connect to it
        instead of loading the model again, and it exits after
        ``SHARDLINE_ENGINE_IDLE_TIMEOUT`` seconds (default 600) without work. Off, each
        task instance loads its own engine in its own process.
    :param progress_interval: seconds between progress lines in the task log (rows done of
        rows known, errors, tokens/s, ETA, and the engine's health).

    Returns one manifest for one shard, else a list of manifests. A shard already done
    with this job's fingerprint is skipped (its manifest is returned), so clearing a
    task reruns only its own shards, and only what is not done. The engine comes from
    the engine service (or this process's engine cache) and stays loaded for later task
    instances. ``on_kill`` aborts the shards' requests in the engine and writes nothing;
    a task process killed outright (SIGKILL) breaks its connection, and the service
    aborts its shards' requests the same way.
    """

    template_fields: Sequence[str] = ("job", "shards", "storage_conn_id")
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        job: BatchJob | Mapping[str, Any] | str,
        shards: ShardValue | Sequence[ShardValue],
        storage_conn_id: str | None = None,
        engine_service: bool = True,
        progress_interval: float = DEFAULT_INTERVAL_SECONDS,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.job = job if isinstance(job, str) else job_fields(job)  # a str is a template
        self.shards = shards
        self.storage_conn_id = storage_conn_id
        self.engine_service = engine_service
        if not progress_interval > 0:
            raise ValueError(f"progress_interval must be a positive number of seconds, got {progress_interval!r}")
        self.progress_interval = progress_interval
        self._batch: ShardBatch | None = None

    def execute(self, context: Context) -> dict[str, Any] | list[dict[str, Any]]:
        from shardline.tasks.shard_job import task_may_retry  # the engine's modules: at run time only

        job = make_job(self.job, get_storage_options(self.storage_conn_id))
        rendered = self.shards  # one shard or a list of them
        one = isinstance(rendered, Mapping)
        shards = [shard_from_xcom(value) for value in ([rendered] if isinstance(rendered, Mapping) else rendered)]
        self._batch = ShardBatch(job, engine_service=self.engine_service)
        try:
            manifests = self._batch.run(shards, log=self.log, progress_interval=self.progress_interval)
        except PipelineError as exc:  # one line naming operation and object (tasks/errors.py)
            if task_may_retry(exc):
                raise  # an engine that failed: Airflow's retries may run the task again
            # permanent (a bad shard, access denied, a missing bucket) or a write that failed after
            # its own retries: an Airflow retry would only repeat it, or recompute the engine's work
            raise AirflowFailException(str(exc)) from exc
        # XCom values are JSON: each manifest as its JSON object (as in _manifests/).
        return manifests[0].to_json() if one else [manifest.to_json() for manifest in manifests]

    def on_kill(self) -> None:
        if self._batch is not None:
            self._batch.abort()
