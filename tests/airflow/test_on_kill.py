"""Killing a shard task aborts its rows in the engine and leaves no output behind."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from shardline.providers.airflow.shard_batch import ShardBatch, make_job
from shardline.tasks.executor import ShardAborted
from shardline.tasks.sample_data import write_rows
from shardline.tasks.storage import list_shards

from ..waiting import wait_for
from .engine_services import requests_in_flight

ROOT = Path(__file__).resolve().parents[2]
# Rows that cannot finish before the kill: many long completions, few at a time.
ENDLESS = {"max_tokens": 900, "temperature": 0.0, "ignore_eos": True}
FEW_AT_A_TIME = {"max_num_seqs": 4}


def _write_long_shards(prefix: Path, num_shards: int, rows: int = 24) -> None:
    for shard in range(num_shards):
        write_rows(str(prefix / f"part-{shard:05d}.jsonl"),
                   [{"id": f"{shard}-{row}", "prompt": f"Story {row} begins"} for row in range(rows)])


# The child runs the one-shard test DAG, whose task runs on the shared engine service;
# a watcher thread (it only asks the service) writes the marker once the engine holds
# the shard's requests, which is when the test kills the child.
CHILD = textwrap.dedent("""
    import json, sys, threading, time
    from tests.airflow.dag_runs import run_dag, task_states
    from tests.airflow.engine_services import service_info

    conf, marker = json.loads(sys.argv[1]), sys.argv[2]
    model, options = conf["job"]["model"], conf["job"]["engine_options"]

    def watch():
        while service_info(model, options)["unfinished_requests"] == 0:
            time.sleep(0.05)
        open(marker, "w").close()

    threading.Thread(target=watch, daemon=True).start()
    dag_run = run_dag("shardline_one_shard", conf)
    print("RESULT " + json.dumps({"state": str(dag_run.state), "tasks": [str(s) for s in task_states(dag_run).values()],
                                  "service": service_info(model, options)}, default=repr), flush=True)
""")

def test_sigterm_runs_on_kill_which_aborts_the_shard_and_writes_nothing(airflow_db, tmp_path, tiny_model):
    _write_long_shards(tmp_path / "in", num_shards=1)
    [shard] = list_shards(str(tmp_path / "in"))
    job = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "model": tiny_model,
           "sampling": ENDLESS, "engine_options": FEW_AT_A_TIME}
    conf = {"job": job, "shard": {"uri": shard.uri, "key": shard.key, "format": shard.format, "size": shard.size},
            "storage_conn_id": None}
    marker = tmp_path / "rows-in-engine"
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(conf), str(marker)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: marker.exists() or child.poll() is not None, "the shard's rows to reach the engine")
        assert child.poll() is None, "the DAG run ended before the kill"
        child.send_signal(signal.SIGTERM)  # what Airflow's supervisor sends a task it stops
        output, _ = child.communicate(timeout=240)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, output[-3000:]
    [result] = [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]
    assert result["tasks"] == ["failed"] and result["service"]["unfinished_requests"] == 0
    assert result["service"]["loads"] == 1 and result["service"]["pid"] != child.pid
    finished, total = map(int, re.search(r"was aborted; (\d+) of (\d+) row\(s\) had finished", output).groups())
    assert finished < total == 24  # stopped mid-shard, not after it
    assert not (tmp_path / "out").exists() or not any(p.is_file() for p in (tmp_path / "out").rglob("*"))


@pytest.mark.parametrize("engine_service", [True, False], ids=["engine-service", "in-process"])
def test_abort_from_another_thread_stops_every_shard_of_a_batch(tmp_path, tiny_model, engine_service):
    _write_long_shards(tmp_path / "in", num_shards=3, rows=8)
    job = make_job({"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "model": tiny_model,
                    "sampling": ENDLESS, "engine_options": FEW_AT_A_TIME, "shards_in_flight": 3}, {})
    batch = ShardBatch(job, engine_service=engine_service)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            batch.run(list_shards(job.input))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    wait_for(lambda: requests_in_flight(tiny_model, FEW_AT_A_TIME, engine_service) > 0, "rows in the engine")
    batch.abort()
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ShardAborted)
    assert requests_in_flight(tiny_model, FEW_AT_A_TIME, engine_service) == 0
    assert not any(p.is_file() for p in (tmp_path / "out").rglob("*"))
