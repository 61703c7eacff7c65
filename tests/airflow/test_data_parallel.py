"""The example DAG with ``data_parallel_size=2``: the host's engine service runs two engine
replicas, and the outputs are the ones a single engine writes."""

from __future__ import annotations

import pyarrow.parquet as pq

from shardline.tasks import BatchJob, list_shards, process_shard
from shardline.tasks.process_tree import command_line, descendants
from shardline.tasks.sample_data import write_sample_dataset

from .dag_runs import run_dag, task_states

DS = "date=2025-01-02"
SAMPLING = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
ENGINE = {"max_num_seqs": 4}


def test_the_example_dag_with_two_replicas_writes_one_engines_outputs(airflow_db, tmp_path, tiny_model):
    write_sample_dataset(str(tmp_path / "in" / DS), num_shards=3, rows_per_shard=6)
    conf = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "model": tiny_model,
            "sampling": SAMPLING, "engine_options": ENGINE, "storage_conn_id": None, "data_parallel_size": 2}
    dag_run = run_dag("shardline_batch", conf)
    assert str(dag_run.state) == "success", task_states(dag_run)

    from shardline.tasks.engine_client import ServiceClient

    service = ServiceClient(tiny_model, ENGINE, data_parallel_size=2).service_info()
    replicas = [pid for pid in descendants(service["pid"]) if "shardline.tasks.replica" in command_line(pid)]
    assert len(replicas) == 2 and service["driver"]["requests_added"] > 0
    job = BatchJob(input=str(tmp_path / "in" / DS), output=str(tmp_path / "reference"), model=tiny_model,
                   sampling=SAMPLING, engine_options=ENGINE)
    for shard in list_shards(job.input):
        written = pq.read_table(tmp_path / "out" / DS / f"{shard.key}.parquet").to_pylist()
        assert written == pq.read_table(process_shard(shard, job).output.removeprefix("file://")).to_pylist()
