"""The example DAG end to end with ``dag.test()``: list shards, map the operator over
them, outputs and manifests as the Prefect flow writes them, manifests in XCom, skip on
rerun, one engine for every task instance of the process."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from shardline.tasks import BatchJob, list_shards, process_shard
from shardline.tasks.engine_cache import num_cached_engines
from shardline.tasks.sample_data import write_sample_dataset

from .dag_runs import run_dag, task_states, xcom_bytes, xcom_values

DS = "date=2025-01-02"
SAMPLING = {"max_tokens": 4, "temperature": 0.0}
ENGINE = {"max_num_seqs": 16}


def _conf(input_prefix: str, output_prefix: str, model: str, **overrides) -> dict:
    return {"input": input_prefix, "output": output_prefix, "model": model, "sampling": SAMPLING,
            "engine_options": ENGINE, "pass_through": ["topic"], "storage_conn_id": None, **overrides}


def _manifest_times(output: str) -> dict[str, float]:
    folder = os.path.join(output, DS, "_manifests")
    return {name: os.path.getmtime(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
            if name.endswith(".json")}


def test_example_dag_runs_every_shard_and_pushes_only_manifests(airflow_db, tmp_path, tiny_model):
    write_sample_dataset(str(tmp_path / "in" / DS), num_shards=4, rows_per_shard=5)
    dag_run = run_dag("shardline_batch", _conf(str(tmp_path / "in"), str(tmp_path / "out"), tiny_model))

    assert str(dag_run.state) == "success", task_states(dag_run)
    assert sorted(task_states(dag_run)) == [("batch_usage", -1)] + [("infer", i) for i in range(4)] + [
        ("list_shards", -1)]
    assert num_cached_engines() == 1  # four task instances, one engine loaded in this process

    job = BatchJob(input=str(tmp_path / "in" / DS), output=str(tmp_path / "out" / DS), model=tiny_model,
                   sampling=SAMPLING, engine_options=ENGINE, pass_through=["topic"])
    shards = list_shards(job.input)
    manifests = xcom_values(dag_run, "infer")
    assert [manifests[i]["shard"] for i in range(4)] == [shard.key for shard in shards]
    reference = job.model_copy(update={"output": str(tmp_path / "reference")})
    for index, shard in enumerate(shards):
        manifest = manifests[index]
        assert set(manifest) >= {"rows", "errors", "fingerprint", "output"} and "text" not in manifest
        assert xcom_bytes(manifest) < 4096
        output = pq.read_table(tmp_path / "out" / DS / f"{shard.key}.parquet")
        expected = pq.read_table(process_shard(shard, reference).output.removeprefix("file://"))
        assert output.column_names == expected.column_names  # the Prefect flow's output contract
        assert output.drop(["error"]).to_pylist() == expected.drop(["error"]).to_pylist()
        assert output.column("error").to_pylist() == expected.column("error").to_pylist()
        assert manifest["rows"] == output.num_rows and manifest["fingerprint"]
    assert sum(m["errors"] for m in manifests.values()) == 3  # the sample's three bad rows, kept in order

    usage = xcom_values(dag_run, "batch_usage")[-1]  # the job's totals: the sums of the manifests
    for name in ("rows", "errors", "prompt_tokens", "completion_tokens", "cached_prompt_tokens"):
        assert usage["totals"][name] == sum(m[name] for m in manifests.values()), name
    with open(tmp_path / "out" / DS / "_batch.json") as handle:
        assert json.load(handle) == usage["batch"]
    rows = sum(m["rows"] for m in manifests.values())
    assert usage["batch"]["request_counts"] == {"total": rows, "completed": rows - 3, "failed": 3}
    assert usage["batch"]["usage"]["output_tokens"] == usage["totals"]["completion_tokens"]


def test_rerun_skips_done_shards_and_redoes_only_a_missing_one(airflow_db, tmp_path, tiny_model):
    write_sample_dataset(str(tmp_path / "in" / DS), num_shards=3, rows_per_shard=3, with_bad_rows=False)
    conf = _conf(str(tmp_path / "in"), str(tmp_path / "out"), tiny_model)
    first = run_dag("shardline_batch", conf)
    assert str(first.state) == "success", task_states(first)
    written = _manifest_times(str(tmp_path / "out"))
    first_manifests = xcom_values(first, "infer")

    again = run_dag("shardline_batch", conf)  # dag.test() clears every task instance and reruns
    assert str(again.state) == "success", task_states(again)
    assert _manifest_times(str(tmp_path / "out")) == written  # nothing rewritten
    assert xcom_values(again, "infer") == first_manifests  # skipped shards still report their manifest

    os.remove(tmp_path / "out" / DS / "part-00001.parquet")
    redo = run_dag("shardline_batch", conf)
    assert str(redo.state) == "success", task_states(redo)
    after = _manifest_times(str(tmp_path / "out"))
    assert {name for name in after if after[name] != written[name]} == {"part-00001.json"}
    assert (tmp_path / "out" / DS / "part-00001.parquet").exists()


def test_shards_per_task_groups_shards_and_pushes_a_list_of_manifests(airflow_db, tmp_path, tiny_model):
    write_sample_dataset(str(tmp_path / "in" / DS), num_shards=3, rows_per_shard=2, with_bad_rows=False)
    dag_run = run_dag("shardline_batch", _conf(str(tmp_path / "in"), str(tmp_path / "out"), tiny_model,
                                               shards_per_task=2))
    assert str(dag_run.state) == "success", task_states(dag_run)
    manifests = xcom_values(dag_run, "infer")
    assert [[m["shard"] for m in manifests[i]] for i in sorted(manifests)] == [
        ["part-00000", "part-00001"], ["part-00002"]]


def test_the_dag_form_takes_a_structured_output_constraint(airflow_db, tmp_path, tiny_model):
    write_sample_dataset(str(tmp_path / "in" / DS), num_shards=1, rows_per_shard=4, with_bad_rows=False)
    choices = ["yes", "no"]
    dag_run = run_dag("shardline_batch", _conf(str(tmp_path / "in"), str(tmp_path / "out"), tiny_model,
                                               structured_outputs={"choice": choices}))
    assert str(dag_run.state) == "success", task_states(dag_run)
    output = pq.read_table(tmp_path / "out" / DS / "part-00000.parquet").to_pylist()
    assert [row["text"] for row in output if row["error"] is None] and all(
        row["text"] in choices for row in output if row["error"] is None)
    assert all(row["finish_reason"] == "length" for row in output if row["error"] is not None)
    assert "parsed" in output[0]


def test_credentials_in_dag_code_are_refused(tiny_model):
    from shardline.providers.airflow import ShardInferenceOperator
    from shardline.providers.airflow.shard_batch import CredentialsInDagError

    job = {"input": "s3://b/in", "output": "s3://b/out", "model": tiny_model,
           "storage_options": {"key": "AKIA", "secret": "oops"}}
    with pytest.raises(CredentialsInDagError, match="storage_conn_id"):
        ShardInferenceOperator(task_id="infer", job=job, shards=[])
    with pytest.raises(CredentialsInDagError, match="storage_conn_id"):
        ShardInferenceOperator(task_id="infer", job=BatchJob(**job), shards=[])
