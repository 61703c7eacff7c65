"""The example DAG on a real S3 server (SeaweedFS), its credentials only in an
Airflow connection given as an AIRFLOW_CONN_* variable."""

from __future__ import annotations

import io
import json

import pyarrow.parquet as pq

from shardline.tasks.sample_data import write_sample_dataset
from shardline.tasks.storage import filesystem

from .dag_runs import run_dag, task_states, xcom_values

DS = "date=2025-01-02"


def test_example_dag_on_s3_with_credentials_from_an_airflow_connection(
        airflow_db, s3_server, tiny_model, monkeypatch, no_aws_environment, capfd, caplog):
    prefix = s3_server.new_prefix()
    write_sample_dataset(f"s3://{prefix}/in/{DS}", num_shards=2, rows_per_shard=3,
                         storage_options=s3_server.storage_options())
    monkeypatch.setenv("AIRFLOW_CONN_SHARDLINE_STORAGE", json.dumps({
        "conn_type": "aws", "login": s3_server.access_key, "password": s3_server.secret_key,
        "extra": {"endpoint_url": s3_server.endpoint_url, "region_name": "us-east-1"}}))
    dag_run = run_dag("shardline_batch", {
        "input": f"s3://{prefix}/in", "output": f"s3://{prefix}/out", "model": tiny_model,
        "sampling": {"max_tokens": 3, "temperature": 0.0}, "engine_options": {"max_num_seqs": 16},
        "pass_through": [], "storage_conn_id": "shardline_storage", "shards_per_task": 1})

    assert str(dag_run.state) == "success", task_states(dag_run)
    fs, _ = filesystem(f"s3://{prefix}", s3_server.storage_options())
    fs.invalidate_cache()
    assert sorted(fs.find(f"{prefix}/out")) == [  # outputs, manifests, job record and usage, no temporary objects
        f"{prefix}/out/{DS}/_batch.json", f"{prefix}/out/{DS}/_job.json",
        f"{prefix}/out/{DS}/_manifests/part-00000.json", f"{prefix}/out/{DS}/_manifests/part-00001.json",
        f"{prefix}/out/{DS}/part-00000.parquet", f"{prefix}/out/{DS}/part-00001.parquet"]
    manifests = xcom_values(dag_run, "infer")
    for index, key in enumerate(["part-00000", "part-00001"]):
        assert manifests[index]["output"] == f"s3://{prefix}/out/{DS}/{key}.parquet"
        table = pq.read_table(io.BytesIO(fs.cat_file(f"{prefix}/out/{DS}/{key}.parquet")))
        assert table.num_rows == manifests[index]["rows"] == 4  # three rows and one bad row
    recorded = json.dumps(xcom_values(dag_run, "list_shards")) + json.dumps(manifests) + \
        "".join(fs.cat_file(path).decode() for path in fs.find(f"{prefix}/out/{DS}/_manifests"))
    captured = capfd.readouterr()
    for text in (recorded, captured.out, captured.err, caplog.text):
        assert s3_server.secret_key not in text
