"""The worker host's shared engine service: task instances in separate processes share
one engine load; a killed task's shard leaves the engine; idle and dead services go."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardline.providers.airflow.shard_batch import ShardBatch, make_job
from shardline.tasks import engine_cache
from shardline.tasks.engine_cache import EngineHost
from shardline.tasks.engine_client import _is_engine_service, service_files
from shardline.tasks.sample_data import write_rows
from shardline.tasks.storage import list_shards

from ..waiting import wait_for
from .conftest import stop_engine_services
from .engine_services import service_info

ROOT = Path(__file__).resolve().parents[2]
SHORT = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
ENDLESS = {"max_tokens": 900, "temperature": 0.0, "ignore_eos": True}
OPTIONS = {"max_num_seqs": 4}


@pytest.fixture
def runtime_dir(monkeypatch):
    """A private runtime directory (short: socket paths are limited) and a load-events file;
    every service started there is stopped afterwards."""
    path = Path(tempfile.mkdtemp(prefix="sl-run-"))
    monkeypatch.setenv("SHARDLINE_RUNTIME_DIR", str(path))
    monkeypatch.setenv("SHARDLINE_ENGINE_EVENTS", str(path / "events.jsonl"))
    yield path
    engine_cache.close_engines()
    stop_engine_services(path)


def _loads(runtime_dir: Path) -> list[dict]:
    events = runtime_dir / "events.jsonl"
    return [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []


def _write_shards(prefix: Path, num_shards: int, rows: int) -> None:
    for shard in range(num_shards):
        write_rows(str(prefix / f"part-{shard:05d}.jsonl"),
                   [{"id": f"{shard}-{row}", "prompt": f"Tale {shard} {row} opens"} for row in range(rows)])


# One task instance in its own process, as Airflow 3 runs each: a dag.test() run.
TASK_PROCESS = textwrap.dedent("""
    import json, os, sys
    from datetime import datetime, timezone
    from tests.airflow.dag_runs import run_dag, task_states

    conf, day = json.loads(sys.argv[1]), int(sys.argv[2])
    dag_run = run_dag("shardline_one_shard", conf, logical_date=datetime(2025, 2, day, tzinfo=timezone.utc))
    print("RESULT " + json.dumps({"pid": os.getpid(), "tasks": [str(s) for s in task_states(dag_run).values()]}))
""")


def test_task_instances_in_separate_processes_share_one_engine_load(airflow_db, runtime_dir, tmp_path, tiny_model):
    _write_shards(tmp_path / "in", num_shards=2, rows=5)
    fields = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "model": tiny_model,
              "sampling": SHORT, "engine_options": OPTIONS}
    task_pids = []
    for day, shard in enumerate(list_shards(fields["input"]), start=1):
        conf = {"job": fields, "shard": {"uri": shard.uri, "key": shard.key, "format": shard.format,
                                         "size": shard.size}, "storage_conn_id": None}
        done = subprocess.run([sys.executable, "-c", TASK_PROCESS, json.dumps(conf), str(day)], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        result = json.loads(line[len("RESULT "):])
        assert result["tasks"] == ["success"], done.stdout[-3000:] + done.stderr[-3000:]
        task_pids.append(result["pid"])

    [load] = _loads(runtime_dir)  # one load for both task instances, in neither of their processes
    assert load["pid"] not in task_pids
    info = service_info(tiny_model, OPTIONS)
    assert (info["pid"], info["loads"], info["shards_run"]) == (load["pid"], 1, 2)
    # the service's rows are the rows an engine of the task's own gives
    ShardBatch(make_job({**fields, "output": str(tmp_path / "own")}, {}), engine_service=False).run(
        list_shards(fields["input"]))
    for name in ("part-00000.parquet", "part-00001.parquet"):
        served = pq.read_table(tmp_path / "out" / name).to_pylist()
        own = pq.read_table(tmp_path / "own" / name).to_pylist()
        assert len(served) == 5 and [row["text"] for row in served] == [row["text"] for row in own]


KILLED_TASK = textwrap.dedent("""
    import json, sys
    from shardline.providers.airflow.shard_batch import ShardBatch, make_job
    from shardline.tasks.storage import list_shards

    job = make_job(json.loads(sys.argv[1]), {})
    ShardBatch(job).run(list_shards(job.input))
""")


def test_a_killed_task_process_leaves_no_rows_in_the_engine_and_the_service_serves_on(
        runtime_dir, tmp_path, tiny_model):
    _write_shards(tmp_path / "long", num_shards=1, rows=12)
    long_job = {"input": str(tmp_path / "long"), "output": str(tmp_path / "long-out"), "model": tiny_model,
                "sampling": ENDLESS, "engine_options": OPTIONS}
    before = service_info(tiny_model, OPTIONS)
    task = subprocess.Popen([sys.executable, "-c", KILLED_TASK, json.dumps(long_job)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: service_info(tiny_model, OPTIONS)["unfinished_requests"] > 0 or task.poll() is not None,
                  "the task's rows in the service's engine")
        assert task.poll() is None, "the task ended before the kill"
        task.kill()  # SIGKILL: no on_kill, no goodbye; only the connection breaks
        task.wait()
        wait_for(lambda: service_info(tiny_model, OPTIONS)["unfinished_requests"] == 0,
                  "the service to abort the dead task's shard")
    finally:
        if task.poll() is None:
            task.kill()
            task.wait()
    assert not (tmp_path / "long-out").exists() or not any(p.is_file() for p in (tmp_path / "long-out").rglob("*"))

    _write_shards(tmp_path / "short", num_shards=1, rows=3)
    job = make_job({"input": str(tmp_path / "short"), "output": str(tmp_path / "short-out"), "model": tiny_model,
                    "sampling": SHORT, "engine_options": OPTIONS}, {})
    [manifest] = ShardBatch(job).run(list_shards(job.input))
    assert manifest.rows == 3 and manifest.errors == 0
    after = service_info(tiny_model, OPTIONS)
    assert after["pid"] == before["pid"] and after["loads"] == 1 and len(_loads(runtime_dir)) == 1


def test_an_idle_service_retires_and_removes_its_files(runtime_dir, monkeypatch, tiny_model):
    monkeypatch.setenv("SHARDLINE_ENGINE_IDLE_TIMEOUT", "1")
    client = engine_cache.get_executor(tiny_model, EngineHost.SERVICE, **OPTIONS)
    pid = client.service_info()["pid"]
    files = service_files(tiny_model, OPTIONS, os.environ.get("CUDA_VISIBLE_DEVICES"))
    assert files.sock.exists() and files.key.exists()
    assert files.key.stat().st_mode & 0o777 == 0o600
    wait_for(lambda: not _is_engine_service(pid), "the idle service to exit")
    assert not files.sock.exists() and not files.key.exists() and not files.pid.exists()


def test_a_dead_services_stale_socket_is_replaced_by_a_new_service(runtime_dir, tmp_path, tiny_model):
    first = service_info(tiny_model, OPTIONS)["pid"]
    os.kill(first, signal.SIGKILL)  # dies without removing its socket
    wait_for(lambda: not _is_engine_service(first), "the service to die")
    files = service_files(tiny_model, OPTIONS, os.environ.get("CUDA_VISIBLE_DEVICES"))
    assert files.sock.exists()

    _write_shards(tmp_path / "in", num_shards=1, rows=3)
    job = make_job({"input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "model": tiny_model,
                    "sampling": SHORT, "engine_options": OPTIONS}, {})
    [manifest] = ShardBatch(job).run(list_shards(job.input))
    assert manifest.rows == 3 and manifest.errors == 0
    second = service_info(tiny_model, OPTIONS)
    assert second["pid"] != first and second["loads"] == 1
    assert [load["pid"] for load in _loads(runtime_dir)] == [first, second["pid"]]
