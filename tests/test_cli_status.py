"""``shardline status OUTPUT``: what a job committed so far, read back from storage.

A half-finished output on a real S3 server (SeaweedFS): the job record lists three
shards, two are committed; then the run ends with the third failed.
"""

from __future__ import annotations

import json
import time

import pytest

from shardline.cli import main
from shardline.tasks.sample_data import write_sample_dataset
from shardline.tasks.shard_job import process_shard
from shardline.tasks.status import output_status, write_job_record
from shardline.tasks.storage import filesystem, list_shards
from shardline.tasks.summary import job_summary, shard_entry
from shardline.tasks.usage import write_batch_object


def _status(capsys, output: str, options: dict, *flags: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what ran before (a model loading) is not the command's
    code = main(["status", output, "--storage-options", json.dumps(options), *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_status_of_a_half_finished_output_on_s3(s3_server, make_job, capsys):
    prefix = s3_server.new_prefix()
    options = s3_server.storage_options()
    write_sample_dataset(f"s3://{prefix}/in", num_shards=3, rows_per_shard=4, storage_options=options)
    job = make_job(input=f"s3://{prefix}/in", output=f"s3://{prefix}/out", storage_options=options)
    shards = list_shards(job.input, options)
    created_at = time.time()
    write_job_record(job, shards, created_at)
    manifests = [process_shard(shard, job) for shard in shards[:2]]  # the third is not committed yet

    code, out, err = _status(capsys, job.output, options, "--json")
    assert code == 0 and err == ""
    status = json.loads(out)
    assert status["state"] == "unfinished" and status["model"] == job.model and status["input"] == job.input
    assert [(s["shard"], s["status"]) for s in status["shards"]] == [
        ("part-00000", "done"), ("part-00001", "done"), ("part-00002", "missing")]
    for entry, manifest in zip(status["shards"], manifests):
        assert (entry["rows"], entry["errors"], entry["completion_tokens"]) == \
            (manifest.rows, manifest.errors, manifest.completion_tokens)
        assert entry["seconds"] == round(sum(manifest.seconds.values()), 3) > 0
    totals = status["totals"]
    assert (totals["shards"], totals["done"], totals["failed"], totals["missing"]) == (3, 2, 0, 1)
    assert totals["rows"] == sum(m.rows for m in manifests) and totals["errors"] == sum(m.errors for m in manifests)

    code, out, _ = _status(capsys, job.output, options)
    assert code == 0 and "part-00002  missing" in out and "2 done/0 failed/1 missing" in out
    assert "not finished (running, or stopped before its end)" in out
    assert s3_server.secret_key not in out

    entries = [shard_entry(s.key, "done", m) for s, m in zip(shards, manifests)]
    entries.append(shard_entry(shards[2].key, "failed", message="engine run failed for shard part-00002"))
    write_batch_object(job, job_summary(entries, 1.0, job.output), created_at)  # the run ends
    finished = output_status(job.output, options)
    assert finished.state == "finished"
    assert [(s.shard, s.status, s.message) for s in finished.shards][2] == \
        ("part-00002", "failed", "engine run failed for shard part-00002")
    code, out, _ = _status(capsys, job.output, options)
    assert "failed part-00002: engine run failed for shard part-00002" in out and "job: finished" in out


def test_status_without_a_job_record_lists_the_committed_shards(tmp_path, make_job, capsys):
    write_sample_dataset(str(tmp_path / "in"), num_shards=2, rows_per_shard=3)
    job = make_job()
    shard = list_shards(job.input)[1]
    manifest = process_shard(shard, job)
    status = output_status(job.output)
    assert status.state == "unknown" and [(s.shard, s.status, s.rows) for s in status.shards] == \
        [(shard.key, "done", manifest.rows)]
    code, out, _ = _status(capsys, job.output, {})
    assert code == 0 and "shards not committed yet cannot be listed" in out


def test_an_unreadable_manifest_is_reported_not_skipped(tmp_path, make_job):
    write_sample_dataset(str(tmp_path / "in"), num_shards=1, rows_per_shard=3)
    job = make_job()
    [shard] = list_shards(job.input)
    process_shard(shard, job)
    fs, path = filesystem(job.output)
    fs.pipe_file(f"{path}/_manifests/{shard.key}.json", b'{"shard": "part-00000"')
    [entry] = output_status(job.output).shards
    assert entry.status == "failed" and "cannot be read" in (entry.message or "")


@pytest.mark.parametrize("where", ["empty", "absent"])
def test_a_prefix_that_is_no_output_is_refused_in_one_line(tmp_path, capsys, where):
    output = tmp_path / "nothing"
    if where == "empty":
        output.mkdir()
    code, out, err = _status(capsys, str(output), {})
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "not the output prefix of a shardline job" in err and str(output) in err
