"""Example DAG: batch inference over one day's prompt shards, one mapped task per shard.

Trigger it with a form (the params below) or let the daily schedule and backfills
fill ``{{ ds }}``: each run reads ``<input>/date=<ds>`` and writes ``<output>/date=<ds>``.
Credentials come from the Airflow connection named by ``storage_conn_id``, e.g.

    AIRFLOW_CONN_SHARDLINE_STORAGE='{"conn_type": "aws", "login": "KEY", "password": "SECRET",
                                     "extra": {"endpoint_url": "http://127.0.0.1:8333"}}'

Each mapped task instance runs in its own worker process and loads the model there
once (shards_per_task > 1 amortises that over several shards). Size
``max_active_tis_per_dag`` (or a pool) to the GPUs the workers have.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag

from shardline.engine.config import QUANTIZATIONS
from shardline.engine.sampling.reasoning import REASONING_PARSERS
from shardline.engine.tools import TOOL_CALL_PARSERS
from shardline.providers.airflow import ShardInferenceOperator, batch_usage, list_shards

JOB = {
    "input": "{{ params.input }}/date={{ ds }}",
    "output": "{{ params.output }}/date={{ ds }}",
    "model": "{{ params.model }}",
    "sampling": "{{ params.sampling }}",
    "engine_options": "{{ params.engine_options }}",
    "pass_through": "{{ params.pass_through }}",
    "structured_outputs": "{{ params.structured_outputs }}",
    "reasoning_parser": "{{ params.reasoning_parser }}",
    "tool_call_parser": "{{ params.tool_call_parser }}",
    "quantization": "{{ params.quantization }}",
    "data_parallel_size": "{{ params.data_parallel_size }}",
}


@dag(
    dag_id="shardline_batch",
    schedule="@daily",
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,  # ints stay ints, lists stay lists
    params={
        "input": Param("s3://my-bucket/prompts", type="string", description="Prefix of the prompt shards."),
        "output": Param("s3://my-bucket/completions", type="string", description="Prefix for outputs."),
        "model": Param("Qwen/Qwen3-0.6B", type="string", description="Hub id or local model directory."),
        "sampling": Param({"max_tokens": 256, "temperature": 0.0}, type="object",
                          description="Sampling defaults (vLLM names); rows may override some."),
        "engine_options": Param({}, type="object", description="Engine options (vLLM names)."),
        "pass_through": Param([], type="array", description="Input columns copied to the output."),
        "structured_outputs": Param(
            None, type=["null", "object"],
            description="Constrain every output: one of json_schema, choice, regex, grammar or json_object, "
                        "e.g. {\"json_schema\": {...}, \"disable_any_whitespace\": true}; JSON outputs are "
                        "validated into a `parsed` column."),
        "reasoning_parser": Param(None, type=["null", "string"], enum=[None, *REASONING_PARSERS],
                                  description="Split a reasoning model's thinking into a `reasoning` column."),
        "tool_call_parser": Param(None, type=["null", "string"], enum=[None, *TOOL_CALL_PARSERS],
                                  description="Read the tool calls of requests that offer tools (none: the one "
                                              "the chat template implies) into `tool_calls`."),
        "quantization": Param(None, type=["null", "string"], enum=[None, *QUANTIZATIONS],
                              description="fp8 or int8: quantize the checkpoint's linears at load; or the "
                                          "quantized checkpoint's own format."),
        "storage_conn_id": Param("shardline_storage", type=["null", "string"],
                                 description="Airflow connection with the storage credentials."),
        "shards_per_task": Param(1, type="integer", minimum=1),
        "data_parallel_size": Param(1, type="integer", minimum=1,
                                    description="Engine replicas on each worker, one per GPU (group), fed from "
                                                "one queue of rows."),
    },
    tags=["shardline"],
)
def shardline_batch():
    # A template in place of the int: rendered as a native int (render_template_as_native_obj).
    shards = list_shards(job=JOB, storage_conn_id="{{ params.storage_conn_id }}",
                         shards_per_task="{{ params.shards_per_task }}")  # pyright: ignore[reportArgumentType]
    infer = ShardInferenceOperator.partial(
        task_id="infer", job=JOB, storage_conn_id="{{ params.storage_conn_id }}", retries=2,
        max_active_tis_per_dag=1,
    ).expand(shards=shards)
    # After every shard, failed ones too: the job's request counts and token usage in
    # <output>/_batch.json and XCom.
    infer >> batch_usage(job=JOB, storage_conn_id="{{ params.storage_conn_id }}")


shardline_batch()
