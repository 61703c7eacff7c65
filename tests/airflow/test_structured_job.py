"""The operator takes the structured-output fields like every other job field: a job's
choice constraint and a row's JSON schema reach the engine, and `parsed` is written."""

from __future__ import annotations

import json

import jsonschema
import pyarrow.parquet as pq

from shardline.providers.airflow.operator import ShardInferenceOperator
from shardline.providers.airflow.shard_batch import job_fields
from shardline.tasks.job import BatchJob
from shardline.tasks.sample_data import write_rows
from shardline.tasks.storage import list_shards

COUNT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}


def test_operator_runs_a_structured_job(tmp_path, tiny_model):
    write_rows(str(tmp_path / "in" / "part-0.jsonl"), [
        {"prompt": "Is the sea wet?"}, {"prompt": "Count to three", "json_schema": json.dumps(COUNT)}])
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=tiny_model,
                   sampling={"max_tokens": 24, "temperature": 0.0}, engine_options={"max_num_seqs": 4},
                   structured_outputs={"choice": ["yes", "no"], "disable_any_whitespace": True})
    shard = list_shards(job.input)[0]
    operator = ShardInferenceOperator(task_id="infer", job=job_fields(job), engine_service=False,
                                      shards={"uri": shard.uri, "key": shard.key, "format": shard.format,
                                              "size": shard.size})
    manifest = operator.execute(context={})
    rows = pq.read_table(tmp_path / "out" / "part-0.parquet").to_pylist()
    assert rows[0]["text"] in ("yes", "no") and rows[0]["error"] is None
    jsonschema.validate(json.loads(rows[1]["parsed"]), COUNT)
    assert manifest["job"]["structured_outputs"]["choice"] == ["yes", "no"] and manifest["invalid_outputs"] == 0
