"""The flow against a real S3 server (SeaweedFS) with real faults: an outage longer than a
minute in the middle of a run, corrupt and truncated shards. Engine work is counted."""

from __future__ import annotations

import gzip
import json
import threading
import time

import pytest

from shardline.flows.batch_inference import batch_inference
from shardline.tasks.engine_cache import engine_requests
from shardline.tasks.sample_data import write_rows, write_sample_dataset
from shardline.tasks.storage import filesystem

from .helpers import everything_as_text, flow_run_record

OUTAGE_SECONDS = 61  # the server is down over a minute on its own; its restart adds more
ROWS = 6  # good rows per shard; the sample's first three shards add one bad row each


def _stop_when_engine_busy(server, requests_before: int, outage: dict) -> None:
    """Stop the server once the engine holds rows (shards are mid-run), restart it later."""
    deadline = time.monotonic() + 300
    while engine_requests() == requests_before and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stop()
    outage["stopped"] = time.monotonic()
    time.sleep(OUTAGE_SECONDS)
    server.start()
    outage["restarted"] = time.monotonic()


# The outage lasts over a minute by design; tests/tasks/test_errors.py keeps the fast check
# that an unreachable store is transient and retried for its budget.
@pytest.mark.slow
def test_a_store_outage_longer_than_a_minute_mid_run_loses_nothing_and_recomputes_nothing(controlled_s3, make_job):
    prefix = controlled_s3.new_prefix()
    options = controlled_s3.storage_options()
    write_sample_dataset(f"s3://{prefix}/in", num_shards=4, rows_per_shard=ROWS, storage_options=options)
    job = make_job(input=f"s3://{prefix}/in", output=f"s3://{prefix}/out", storage_options=options,
                   sampling={"max_tokens": 48, "temperature": 0.0, "ignore_eos": True},
                   engine_options={"max_num_seqs": 4}, shards_in_flight=2)
    before, outage = engine_requests(), {}
    chaos = threading.Thread(target=_stop_when_engine_busy, args=(controlled_s3, before, outage), daemon=True)
    chaos.start()
    state = batch_inference(job, return_state=True)
    chaos.join(timeout=300)
    down = outage["restarted"] - outage["stopped"]
    summary = state.result(raise_on_failure=False)
    assert state.is_completed(), summary
    assert down > 60, f"the outage lasted only {down:.0f}s"
    assert summary["totals"]["done"] == 4 and summary["totals"]["failed"] == 0
    assert engine_requests() - before == 4 * ROWS  # every good row ran exactly once: nothing recomputed
    fs, _ = filesystem(job.output, options)
    fs.invalidate_cache()
    for key in ("part-00000", "part-00001", "part-00002", "part-00003"):
        manifest = json.loads(fs.cat_file(f"{prefix}/out/_manifests/{key}.json"))
        assert manifest["rows"] == ROWS + (1 if key < "part-00003" else 0)
    assert [p for p in fs.find(f"{prefix}/out/_tmp") if p != f"{prefix}/out/_tmp"] == []  # no temporary left
    print(f"\noutage survived: {down:.0f}s; engine requests {engine_requests() - before} for {4 * ROWS} rows")


def test_corrupt_and_truncated_shards_fail_alone_in_one_line_and_cost_no_engine_work(controlled_s3, make_job):
    prefix = controlled_s3.new_prefix()
    options = controlled_s3.storage_options()
    write_sample_dataset(f"s3://{prefix}/in", num_shards=2, rows_per_shard=ROWS, with_bad_rows=False,
                         storage_options=options)
    fs, _ = filesystem(f"s3://{prefix}", options)
    whole = gzip.compress(b"".join(json.dumps({"prompt": f"p{i}"}).encode() + b"\n" for i in range(300)))
    fs.pipe_file(f"{prefix}/in/cut.jsonl.gz", whole[: len(whole) // 2])
    fs.pipe_file(f"{prefix}/in/junk.parquet", b"PAR1 this is not parquet")
    write_rows(f"s3://{prefix}/in/zz-ok.jsonl", [{"prompt": "fine"}], options)
    job = make_job(input=f"s3://{prefix}/in", output=f"s3://{prefix}/out", storage_options=options)
    before = engine_requests()
    started = time.monotonic()
    state = batch_inference(job, return_state=True)
    elapsed = time.monotonic() - started
    summary = state.result(raise_on_failure=False).summary
    by_shard = {entry["shard"]: entry for entry in summary["shards"]}
    assert {k: e["status"] for k, e in by_shard.items()} == {
        "cut": "failed", "junk": "failed", "part-00000": "done", "part-00001": "done", "zz-ok": "done"}
    assert engine_requests() - before == 2 * ROWS + 1  # the good shards' rows, once each
    assert by_shard["cut"]["message"].startswith(f"read s3://{prefix}/in/cut.jsonl.gz failed: not a readable gzip")
    assert by_shard["junk"]["message"].startswith(f"read s3://{prefix}/in/junk.parquet failed: not a readable Parquet")
    assert all("\n" not in e["message"] for e in by_shard.values() if e["message"])
    record = flow_run_record(state.state_details.flow_run_id)
    text = everything_as_text(record)
    assert not any("Retry" in line for line in record["logs"])  # corrupt input is never retried
    assert controlled_s3.secret_key not in text and controlled_s3.secret_key not in repr(summary)
    print(f"\ncorrupt shards: flow finished in {elapsed:.1f}s; engine requests {engine_requests() - before}")


def test_a_flow_run_from_the_ui_fails_its_pre_flight_check_before_any_shard(controlled_s3, make_job):
    prefix = controlled_s3.new_prefix()
    write_sample_dataset(f"s3://{prefix}/in", num_shards=2, rows_per_shard=2,
                         storage_options=controlled_s3.storage_options())
    job = make_job(input=f"s3://{prefix}/in", output=f"s3://{prefix}/out",
                   storage_options=controlled_s3.reader_options())
    before = engine_requests()
    started = time.monotonic()
    state = batch_inference(job, return_state=True)
    elapsed = time.monotonic() - started
    error = state.result(raise_on_failure=False)
    assert state.is_failed() and type(error).__name__ == "PreflightFailed"
    assert str(error).startswith(f"write s3://{prefix}/out/_tmp/.shardline-probe-")
    assert "PermissionError: Access Denied." in str(error) and "\n" not in str(error)
    assert engine_requests() == before
    print(f"\nread-only output: pre-flight failed in {elapsed:.1f}s")
    record = flow_run_record(state.state_details.flow_run_id)
    assert not any("Retry" in line for line in record["logs"])  # a permanent error is never retried
    assert "S3_READER" not in everything_as_text(record) and "READER-SECRET" not in everything_as_text(record)
