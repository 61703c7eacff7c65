"""The flow's progress artifact follows rows, read back through the Prefect client; the
flow logs progress lines and charts its throughput in the summary artifact."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

from shardline.flows.artifacts import ProgressArtifact
from shardline.flows.batch_inference import batch_inference
from shardline.tasks.job import BatchJob
from shardline.tasks.progress import JobProgress, ProgressSnapshot
from shardline.tasks.sample_data import write_rows
from shardline.tasks.shard_job import ShardPipeline
from shardline.tasks.storage import list_shards

from .helpers import flow_run_record

ROWS = 60


def _read_artifact(artifact_id: Any) -> tuple[float, str]:
    with get_client(sync_client=True) as client:
        [artifact] = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))
    assert isinstance(artifact.data, (int, float)) and artifact.description is not None
    return float(artifact.data), artifact.description


@flow
def _one_long_shard(job: BatchJob) -> tuple[list[tuple[int, float, str]], tuple[float, str]]:
    """One shard through the pipeline with the flow's artifact sink; after each update, the
    artifact as the Prefect API holds it. A clock of one second per reading drives it."""
    [shard] = list_shards(job.input)
    ticks = itertools.count()
    progress = JobProgress([shard], clock=lambda: float(next(ticks)))
    artifact = ProgressArtifact(progress, every_seconds=10)
    seen: list[tuple[int, float, str]] = []

    def read_back(snapshot: ProgressSnapshot) -> None:
        seen.append((snapshot.rows_done, *_read_artifact(artifact.artifact_id)))

    progress.add_sink(read_back, every_seconds=10)  # due with the artifact, and after it
    manifest = ShardPipeline(job, progress=progress).process(shard)
    progress.shard_finished(shard.key, manifest)
    progress.finish()
    return seen, _read_artifact(artifact.artifact_id)


def test_the_progress_artifact_moves_with_the_rows_of_a_long_shard(tmp_path, make_job):
    write_rows(str(tmp_path / "in" / "long.parquet"), [{"prompt": f"Row {i} of the long shard"} for i in range(ROWS)])
    seen, final = _one_long_shard(make_job())
    during = [(rows, data, description) for rows, data, description in seen if 0 < rows < ROWS]
    assert len(during) >= 3, seen
    for rows, data, description in during:
        assert data == round(100 * rows / ROWS, 2)
        assert description.startswith(f"rows {rows} of {ROWS} ") and "tok/s" in description and "engine:" in description
    assert [data for _, data, _ in seen] == sorted(data for _, data, _ in seen)
    assert final[0] == 100.0 and final[1].startswith(f"rows {ROWS} of {ROWS} (100%)")


def test_the_flow_logs_progress_and_charts_its_throughput(tmp_path, make_job):
    for part in range(2):
        write_rows(str(tmp_path / "in" / f"part-{part}.jsonl"), [{"prompt": f"Row {i}"} for i in range(6)])
    state = batch_inference(make_job(shards_in_flight=1), progress_interval=3600, return_state=True)
    summary = state.result()
    record = flow_run_record(state.state_details.flow_run_id)
    lines = [log for log in record["logs"] if log.startswith("progress: ")]
    assert lines and lines[-1].startswith("progress: rows 12 of 12 (100%) | 0 error(s) | shards 2 of 2 finished")
    assert record["artifacts"]["batch-inference-progress"].data == 100.0
    spans = summary["throughput"]
    assert spans and spans[0]["from_seconds"] == 0.0 and spans[-1]["to_seconds"] > 0
    assert sum(span["tokens_per_second"] * (span["to_seconds"] - span["from_seconds"]) for span in spans) == \
        pytest.approx(summary["totals"]["completion_tokens"], rel=0.01)
    assert "## Throughput over the run" in record["artifacts"]["batch-inference-summary"].data
