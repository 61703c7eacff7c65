"""Duplicate rows computed once are reported: the manifest, the job summary and _batch.json
count them, and their outputs equal those of a job that computes every row."""

from __future__ import annotations

import json
import time

import pyarrow.parquet as pq

from shardline.tasks.manifest import ShardManifest
from shardline.tasks.sample_data import write_rows
from shardline.tasks.shard_job import process_shard
from shardline.tasks.storage import list_shards
from shardline.tasks.summary import job_summary, shard_entry, summary_table
from shardline.tasks.usage import batch_object

PROMPTS = ["Name a colour.", "Count to three.", "Name a colour.", "Name a colour.", "Say hi.", "Count to three."]


def _run(tmp_path, make_job, name: str, **engine_options):
    rows: list[dict[str, object]] = [{"id": f"r{i}", "prompt": prompt} for i, prompt in enumerate(PROMPTS)]
    rows.append({"id": "r6", "prompt": "Name a colour.", "max_tokens": 2})  # other params: computed apart
    write_rows(str(tmp_path / name / "in" / "part-0.parquet"), rows)
    job = make_job(input=str(tmp_path / name / "in"), output=str(tmp_path / name / "out"),
                   engine_options={"max_num_seqs": 16, **engine_options})
    manifest = process_shard(list_shards(job.input)[0], job)
    return job, manifest, pq.read_table(tmp_path / name / "out" / "part-0.parquet").to_pylist()


def test_collapsed_rows_are_counted_and_equal_computed_ones(tmp_path, make_job):
    job, manifest, rows = _run(tmp_path, make_job, "collapsed")
    _, computed, computed_rows = _run(tmp_path, make_job, "computed", collapse_duplicate_requests=False)
    assert [r["text"] for r in rows] == [r["text"] for r in computed_rows]
    assert [r["completion_tokens"] for r in rows] == [r["completion_tokens"] for r in computed_rows]
    assert rows[0]["text"] != rows[1]["text"] or rows[0]["text"] != rows[4]["text"]  # outputs follow prompts
    assert manifest.collapsed_rows == 3 and computed.collapsed_rows == 0
    assert (manifest.rows, manifest.completion_tokens) == (computed.rows, computed.completion_tokens)
    on_disk = json.loads((tmp_path / "collapsed" / "out" / "_manifests" / "part-0.json").read_text())
    assert on_disk["collapsed_rows"] == 3 and ShardManifest.from_json(on_disk) == manifest

    summary = job_summary([shard_entry("part-0", "done", manifest), shard_entry("part-1", "failed", message="x")],
                          1.0, job.output)
    assert summary["totals"]["collapsed_rows"] == 3
    assert "3 of the 7 row(s) repeated another row exactly" in summary_table(summary)
    assert batch_object(job, summary, time.time())["collapsed_rows"] == 3


def test_a_manifest_written_before_collapsed_rows_reads_as_none():
    old = {"shard": "s", "input": "i", "output": "o", "rows": 1, "errors": 0, "prompt_tokens": 3,
           "completion_tokens": 2, "seconds": {}, "written_at": "t", "fingerprint": "f", "job": {}}
    manifest = ShardManifest.from_json(old)
    assert manifest.collapsed_rows is None and "collapsed_rows" not in manifest.to_json()
    assert shard_entry("s", "skipped", manifest)["collapsed_rows"] == 0
