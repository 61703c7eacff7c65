"""A permanent error in a mapped shard task fails that task instance for good, in one
line naming the object, without Airflow retries; the other shards succeed."""

from __future__ import annotations

import gzip
import json
import time

from shardline.tasks.sample_data import write_sample_dataset

from .dag_runs import run_dag, task_states

DS = "date=2025-01-02"


def test_a_truncated_shard_fails_its_task_at_once_and_the_others_succeed(airflow_db, tmp_path, tiny_model, capfd):
    write_sample_dataset(str(tmp_path / "in" / DS), num_shards=2, rows_per_shard=3, with_bad_rows=False)
    whole = gzip.compress(b"".join(json.dumps({"prompt": f"p{i}"}).encode() + b"\n" for i in range(300)))
    (tmp_path / "in" / DS / "zz-cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    started = time.monotonic()
    dag_run = run_dag("shardline_batch", {
        "input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "model": tiny_model,
        "sampling": {"max_tokens": 3, "temperature": 0.0}, "engine_options": {"max_num_seqs": 16},
        "pass_through": [], "storage_conn_id": None, "shards_per_task": 1})
    elapsed = time.monotonic() - started
    states = task_states(dag_run)
    assert states[("infer", 0)] == "success" and states[("infer", 1)] == "success"
    assert states[("infer", 2)] == "failed", states  # not up_for_retry: the example DAG's retries=2 unused
    cut = str(tmp_path / "in" / DS / "zz-cut.jsonl.gz")
    captured = capfd.readouterr()
    assert f"AirflowFailException: read file://{cut} failed: not a readable gzip file, truncated or corrupt" \
        in captured.out + captured.err
    print(f"\ntruncated shard in the DAG: run finished in {elapsed:.1f}s")
