"""Test DAG: ShardInferenceOperator, unmapped, over the one shard the run's conf names."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag

from shardline.providers.airflow import ShardInferenceOperator


@dag(dag_id="shardline_one_shard", schedule=None, start_date=datetime(2025, 1, 1),
     render_template_as_native_obj=True,
     params={"job": Param({}, type="object"), "shard": Param({}, type="object"),
             "storage_conn_id": Param(None, type=["null", "string"])})
def shardline_one_shard():
    ShardInferenceOperator(task_id="infer", job="{{ params.job }}", shards="{{ params.shard }}",
                           storage_conn_id="{{ params.storage_conn_id }}", retries=0)


shardline_one_shard()
