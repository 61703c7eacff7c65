"""The Airflow operator's task log shows progress by rows: the same line as the CLI's
(rows, errors, tokens/s, ETA, the engine's health), driven by the rows of its shards."""

from __future__ import annotations

import logging
import re

from shardline.providers.airflow.shard_batch import ShardBatch, make_job
from shardline.tasks.sample_data import write_rows, write_sample_dataset
from shardline.tasks.status import output_status
from shardline.tasks.storage import list_shards

from .dag_runs import run_dag

DS = "date=2025-01-02"


def test_a_batch_logs_progress_as_its_rows_finish(tmp_path, tiny_model, caplog):
    for part, rows in enumerate((7, 5)):
        write_rows(str(tmp_path / "in" / f"part-{part}.jsonl"), [{"prompt": f"Row {i} of {part}"} for i in range(rows)])
    job = make_job({"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "model": tiny_model,
                    "sampling": {"max_tokens": 3, "temperature": 0.0}, "shards_in_flight": 2}, {})
    log = logging.getLogger("test.airflow.task")
    with caplog.at_level(logging.INFO, logger="test.airflow.task"):
        manifests = ShardBatch(job, engine_service=False).run(list_shards(job.input), log=log, progress_interval=1e-9)
    lines = [record.getMessage() for record in caplog.records if record.name == "test.airflow.task"]
    done = [int(re.match(r"progress: rows (\d+) of", line).group(1)) for line in lines]  # type: ignore[union-attr]
    assert done == sorted(done) and len({rows for rows in done if 0 < rows < 12}) >= 3  # lines as rows finish
    assert lines[-1].startswith("progress: rows 12 of 12 (100%) | 0 error(s) | shards 2 of 2 finished")
    assert "engine: " in lines[-1] and sum(m.rows for m in manifests) == 12
    again = ShardBatch(job, engine_service=False)  # both shards done: skipped, no rows counted as run
    with caplog.at_level(logging.INFO, logger="test.airflow.task"):
        again.run(list_shards(job.input), log=log)
    assert caplog.records[-1].getMessage().startswith("progress: rows 0 of 0 (100%) | 0 error(s) | shards 2 of 2")


def test_the_operators_task_log_carries_the_progress_line(airflow_db, tmp_path, tiny_model, capfd):
    write_sample_dataset(str(tmp_path / "in" / DS), num_shards=1, rows_per_shard=3, with_bad_rows=False)
    run_dag("shardline_batch", {
        "input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "model": tiny_model,
        "sampling": {"max_tokens": 3, "temperature": 0.0}, "engine_options": {"max_num_seqs": 16},
        "pass_through": [], "storage_conn_id": None, "shards_per_task": 1})
    captured = capfd.readouterr()
    assert "progress: rows 3 of 3 (100%) | 0 error(s) | shards 1 of 1 finished" in captured.out + captured.err
    status = output_status(str(tmp_path / "out" / DS))  # the listing's job record, the usage task's batch object
    assert status.state == "finished" and [(s.shard, s.status, s.rows) for s in status.shards] == \
        [("part-00000", "done", 3)]
