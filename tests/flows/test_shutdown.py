"""A flow process stopped with SIGTERM (what Prefect's runner sends a cancelled run):
engine work aborted, the process gone in seconds, nothing partial, a rerun resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from prefect.settings import PREFECT_API_URL

from shardline.flows.batch_inference import batch_inference
from shardline.tasks.engine_cache import engine_requests
from shardline.tasks.process_tree import command_line, descendants, is_alive
from shardline.tasks.sample_data import write_sample_dataset

SHARDS, ROWS = 6, 8
SAMPLING = {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}


def test_sigterm_to_a_flow_process_stops_its_engine_work_and_a_rerun_resumes(tmp_path, make_job):
    write_sample_dataset(str(tmp_path / "in"), num_shards=SHARDS, rows_per_shard=ROWS, with_bad_rows=False)
    job = make_job(sampling=SAMPLING, engine_options={"max_num_seqs": 4}, shards_in_flight=2)
    script = textwrap.dedent(f"""
        from shardline.flows.batch_inference import batch_inference
        from shardline.tasks.job import BatchJob
        batch_inference(BatchJob(**{job.public_fields()!r}))
    """)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    log = open(tmp_path / "flow.log", "wb")
    process = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=log, stderr=subprocess.STDOUT)
    manifests = tmp_path / "out" / "_manifests"
    deadline = time.monotonic() + 240
    while not (manifests.exists() and any(manifests.glob("*.json"))):
        assert process.poll() is None, (tmp_path / "flow.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no shard committed in time"
        time.sleep(0.05)
    tree = {pid: command_line(pid) for pid in descendants(process.pid)}
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)
    stop_seconds = time.monotonic() - started
    time.sleep(0.5)
    assert [pid for pid in tree if is_alive(pid)] == [], tree  # nothing it started outlives it
    assert stop_seconds < 20, stop_seconds
    committed = sorted(p.stem for p in manifests.glob("*.json"))
    assert sorted(p.stem for p in (tmp_path / "out").glob("*.parquet")) == committed  # nothing partial
    assert not any((tmp_path / "out" / "_tmp").glob("*"))

    before = engine_requests()
    summary = batch_inference(job)
    assert sorted(e["shard"] for e in summary["shards"] if e["status"] == "skipped") == committed
    assert engine_requests() - before == ROWS * (SHARDS - len(committed))
    print(f"\nflow SIGTERM: stopped in {stop_seconds:.1f}s, {len(tree)} child process(es) before, none after; "
          f"rerun ran {engine_requests() - before} requests for {SHARDS - len(committed)} shard(s)")
