"""A run killed with SIGKILL mid-shard, then rerun: every shard complete, no row lost
or duplicated, and the shards committed before the kill are not redone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from prefect.settings import PREFECT_API_URL

from shardline.flows.batch_inference import batch_inference
from shardline.tasks.sample_data import write_sample_dataset
from shardline.tasks.shard_reader import read_shard_records
from shardline.tasks.storage import list_shards

from .helpers import output_ids

NUM_SHARDS = 10


def _start_flow_subprocess(tmp_path, tiny_model) -> subprocess.Popen:
    script = textwrap.dedent(f"""
        from shardline.flows.batch_inference import batch_inference
        from shardline.tasks.job import BatchJob
        batch_inference(BatchJob(
            input={str(tmp_path / 'in')!r}, output={str(tmp_path / 'out')!r}, model={tiny_model!r},
            sampling={{"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}},
            engine_options={{"max_num_seqs": 4}}, shards_in_flight=2))
    """)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}  # the session harness's server
    return subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "killed-run.log", "wb"))


def test_sigkill_mid_run_then_rerun_completes_without_loss_or_duplicates(tmp_path, tiny_model, make_job):
    write_sample_dataset(str(tmp_path / "in"), num_shards=NUM_SHARDS, rows_per_shard=16)
    manifests = tmp_path / "out" / "_manifests"
    process = _start_flow_subprocess(tmp_path, tiny_model)
    deadline = time.monotonic() + 240
    while not (manifests.exists() and len(list(manifests.glob("*.json"))) >= 3):
        assert process.poll() is None, (tmp_path / "killed-run.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the flow committed no shard in time"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    committed = {p.stem: json.loads(p.read_text())["written_at"] for p in manifests.glob("*.json")}
    assert 3 <= len(committed) < NUM_SHARDS, "the kill came too late to interrupt the run"

    job = make_job(sampling={"max_tokens": 24, "temperature": 0.0, "ignore_eos": True},
                   engine_options={"max_num_seqs": 4})
    summary = batch_inference(job)
    statuses = {entry["shard"]: entry["status"] for entry in summary["shards"]}
    assert all(statuses[key] == "skipped" for key in committed)
    assert sorted(k for k, s in statuses.items() if s == "done") == sorted(set(statuses) - set(committed))
    for shard in list_shards(job.input):
        expected = [r.get("id") for r in read_shard_records(shard).records]
        assert output_ids(tmp_path / "out" / f"{shard.key}.parquet") == expected  # all rows, in order, once
        assert json.loads((manifests / f"{shard.key}.json").read_text())["rows"] == len(expected)
    assert {p.stem: json.loads(p.read_text())["written_at"] for p in manifests.glob("*.json")
            if p.stem in committed} == committed
    assert sorted(p.name for p in (tmp_path / "out").glob("*.parquet")) == \
        sorted(f"{s.key}.parquet" for s in list_shards(job.input))
    assert list((tmp_path / "out" / "_tmp").glob("*")) == []
