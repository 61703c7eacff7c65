"""A shard whose output was committed is reported done, whatever its task said later."""

from __future__ import annotations

from shardline.tasks.errors import EngineError, ErrorKind, ModelUnusable, StorageDenied
from shardline.tasks.executor import ShardAborted
from shardline.tasks.outcomes import settle_failed
from shardline.tasks.sample_data import write_sample_dataset
from shardline.tasks.shard_job import process_shard, task_may_retry
from shardline.tasks.storage import list_shards
from shardline.tasks.summary import shard_entry


def test_a_failed_entry_of_a_committed_shard_is_settled_as_done(tmp_path, make_job):
    write_sample_dataset(str(tmp_path / "in"), num_shards=2, rows_per_shard=3, with_bad_rows=False)
    job = make_job()
    committed, never_ran = list_shards(job.input)
    manifest = process_shard(committed, job)
    message = "write file:///x failed: ConnectionResetError: reset (still failing after 9 attempt(s) over 300s)"
    entries = [shard_entry(committed.key, "failed", message=message),
               shard_entry(never_ran.key, "failed", message="read file:///y failed: EOFError")]
    settled = {entry["shard"]: entry for entry in settle_failed(entries, [committed, never_ran], job)}
    assert settled[committed.key]["status"] == "done" and settled[committed.key]["rows"] == manifest.rows
    assert message in settled[committed.key]["message"]
    assert settled[never_ran.key]["status"] == "failed"


def test_only_engine_failures_retry_a_shard_task():
    assert task_may_retry(EngineError("run", "shard a on model m", "RunnerError: the driver died"))
    assert not task_may_retry(ModelUnusable("load", "model m", "no config.json"))
    assert not task_may_retry(StorageDenied("write", "s3://b/k", "Access Denied.", ErrorKind.PERMANENT))
    assert not task_may_retry(ShardAborted("shard a was aborted"))
