"""data_parallel_size=2 through the flow: the shards one engine writes, row for row, over a
real S3 server, even with a replica killed with SIGKILL mid-shard (the shard is retried,
no row lost or duplicated); and a run killed (SIGKILL) or stopped (SIGTERM) mid-way leaves no
replica behind and resumes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pyarrow.parquet as pq
import pytest
from prefect.settings import PREFECT_API_URL

from shardline.flows.batch_inference import batch_inference
from shardline.tasks.data_parallel import DataParallelRunner
from shardline.tasks.engine_cache import EngineHost, get_executor
from shardline.tasks.process_tree import command_line, descendants, is_alive
from shardline.tasks.sample_data import write_sample_dataset
from shardline.tasks.shard_reader import read_shard_records
from shardline.tasks.storage import filesystem, list_shards

SAMPLING = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
COLUMNS = ["id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "error"]


def _replicas_of(pid: int) -> list[int]:
    return [child for child in descendants(pid) if "shardline.tasks.replica" in command_line(child)]


def _input_ids(records: list) -> list[str | None]:
    return [record.get("id") if isinstance(record, dict) else None for record in records]


def _outputs(job) -> dict[str, dict]:
    """Each output shard's rows and its manifest's fingerprint, read back from storage."""
    fs, _ = filesystem(job.output, job.storage())
    fs.invalidate_cache()
    found = {}
    for shard in list_shards(job.input, job.storage()):
        with fs.open(f"{job.output}/{shard.key}.parquet".removeprefix("s3://"), "rb") as handle:
            rows = pq.read_table(handle, columns=COLUMNS).to_pylist()
        manifest = json.loads(fs.cat_file(f"{job.output}/_manifests/{shard.key}.json".removeprefix("s3://")))
        found[shard.key] = {"rows": rows, "fingerprint": manifest["fingerprint"]}
    return found


def test_two_replicas_write_one_engines_shards_even_when_one_is_killed_mid_shard(s3_server, make_job, caplog):
    caplog.set_level(logging.INFO, logger="shardline")
    prefix, options = s3_server.new_prefix(), s3_server.storage_options()
    write_sample_dataset(f"s3://{prefix}/in", num_shards=5, rows_per_shard=12, storage_options=options)

    def job(output: str, size: int):
        return make_job(input=f"s3://{prefix}/in", output=f"s3://{prefix}/{output}", storage_options=options,
                        sampling=SAMPLING, engine_options={"max_num_seqs": 4}, shards_in_flight=2,
                        data_parallel_size=size)

    one = batch_inference(job("one", 1))
    assert one["totals"]["done"] == 5
    killed: list[int] = []

    def kill_replica_1_once_it_holds_rows() -> None:
        deadline = time.monotonic() + 300
        while len(_replicas_of(os.getpid())) < 2:  # the run is starting its replicas
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        runner = get_executor(job("two", 2).model, EngineHost.THREAD, 2, **job("two", 2).engine_kwargs())
        assert isinstance(runner, DataParallelRunner)  # the run's own runner, from the engine cache
        while runner.rows_outstanding()[1] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = runner.replica_pids()[1]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_replica_1_once_it_holds_rows, daemon=True)
    killer.start()
    two = batch_inference(job("two", 2))
    killer.join(timeout=5)
    assert killed, "no replica was killed"
    assert "ended (killed by SIGKILL)" in caplog.text and "the shard is retried whole" in caplog.text
    assert two["totals"]["done"] == 5 and two["totals"]["failed"] == 0
    assert _outputs(job("two", 2)) == _outputs(job("one", 1))  # rows, order, errors, fingerprints
    for shard in list_shards(f"s3://{prefix}/in", options):
        assert _input_ids(read_shard_records(shard, options).records) == \
            [row["id"] for row in _outputs(job("two", 2))[shard.key]["rows"]]
    assert not any(is_alive(pid) for pid in _replicas_of(os.getpid())), "a replica outlived the run"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_data_parallel_run_stopped_mid_way_leaves_no_replica_and_resumes(signum, tmp_path, tiny_model, make_job):
    write_sample_dataset(str(tmp_path / "in"), num_shards=6, rows_per_shard=12)
    manifests = tmp_path / "out" / "_manifests"
    script = textwrap.dedent(f"""
        from shardline.flows.batch_inference import batch_inference
        from shardline.tasks.job import BatchJob
        batch_inference(BatchJob(
            input={str(tmp_path / 'in')!r}, output={str(tmp_path / 'out')!r}, model={tiny_model!r},
            sampling={SAMPLING!r}, engine_options={{"max_num_seqs": 4}}, shards_in_flight=2,
            data_parallel_size=2))
    """)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}  # the session harness's server
    process = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL,
                               stderr=open(tmp_path / "killed-run.log", "wb"))
    deadline = time.monotonic() + 300
    while not (manifests.exists() and len(list(manifests.glob("*.json"))) >= 2):
        assert process.poll() is None, (tmp_path / "killed-run.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the flow committed no shard in time"
        time.sleep(0.05)
    tree = descendants(process.pid)  # the replicas, Prefect's API server, ...
    assert len([pid for pid in tree if "shardline.tasks.replica" in command_line(pid)]) == 2
    process.send_signal(signum)
    process.wait(timeout=60)  # SIGTERM: the run aborts its shards and closes its replicas
    deadline = time.monotonic() + 30
    while any(is_alive(pid) for pid in tree):  # SIGKILL: the replicas' ends of their pairs close: they exit
        assert time.monotonic() < deadline, {pid: command_line(pid) for pid in tree if is_alive(pid)}
        time.sleep(0.05)
    committed = {p.stem: json.loads(p.read_text())["written_at"] for p in manifests.glob("*.json")}
    assert 2 <= len(committed) < 6, "the signal came too late to interrupt the run"
    assert sorted(p.stem for p in (tmp_path / "out").glob("*.parquet")) == sorted(committed)  # nothing partial

    job = make_job(sampling=SAMPLING, engine_options={"max_num_seqs": 4}, shards_in_flight=2)  # one engine
    summary = batch_inference(job)
    statuses = {entry["shard"]: entry["status"] for entry in summary["shards"]}
    assert all(statuses[key] == "skipped" for key in committed)  # the replicas' count is not in the fingerprint
    assert sorted(k for k, s in statuses.items() if s == "done") == sorted(set(statuses) - set(committed))
    for shard in list_shards(job.input):
        expected = _input_ids(read_shard_records(shard).records)
        ids = pq.read_table(tmp_path / "out" / f"{shard.key}.parquet", columns=["id"]).column("id").to_pylist()
        assert ids == expected  # every row, in order, once
