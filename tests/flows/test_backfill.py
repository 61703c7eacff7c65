"""The backfill flow for real under Prefect: plans, reprocess behaviours, the cap on
runs in flight, dry runs and idempotent reruns, on local files and on SeaweedFS."""

from __future__ import annotations

import json

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

from shardline.flows.backfill import BackfillFailed, DeploymentParameterError, backfill
from shardline.tasks.partitions import partition_job
from shardline.tasks.sample_data import write_rows, write_sample_dataset
from shardline.tasks.shard_job import process_shard
from shardline.tasks.storage import list_shards

DAYS = [f"date=2026-11-0{day}" for day in range(1, 5)]
RANGE = {"start": "2026-11-01", "end": "2026-11-05"}  # the 5th has no input


def _child_runs(state) -> list:
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[state.state_details.flow_run_id])))


def _max_overlap(runs) -> int:
    edges = sorted([(run.start_time, 1) for run in runs] + [(run.end_time, -1) for run in runs],
                   key=lambda edge: (edge[0], edge[1]))
    in_flight = peak = 0
    for _, step in edges:
        in_flight += step
        peak = max(peak, in_flight)
    return peak


def _written_at(tmp_path, partition) -> dict[str, str]:
    manifests = sorted((tmp_path / "out" / partition / "_manifests").glob("*.json"))
    return {m.stem: json.loads(m.read_text())["written_at"] for m in manifests}


def test_plan_reprocess_cap_and_idempotent_reruns_on_local_files(tmp_path, make_job):
    for day in DAYS:
        write_sample_dataset(str(tmp_path / "in" / day), num_shards=2, rows_per_shard=2)
    job = make_job()
    for shard in list_shards(partition_job(job, DAYS[1]).input):  # the 2nd: completed earlier
        process_shard(shard, partition_job(job, DAYS[1]))
    third = partition_job(job, DAYS[2])
    process_shard(list_shards(third.input)[0], third)  # the 3rd: interrupted after one shard

    plan = backfill(job, RANGE, newest_first=True, dry_run=True)
    assert [(row["partition"], row["status"], row["action"]) for row in plan["partitions"]] == [
        ("date=2026-11-05", "no-input", "skip"), (DAYS[3], "never-run", "run"),
        (DAYS[2], "failed", "skip"), (DAYS[1], "completed", "skip"), (DAYS[0], "never-run", "run")]
    assert "1 of 2 shard(s) done" in plan["partitions"][2]["reason"]
    assert not (tmp_path / "out" / DAYS[0]).exists()  # a dry run writes nothing

    state = backfill(job, RANGE, reprocess="none", max_active_runs=2, return_state=True)
    result = state.result()
    assert {row["partition"]: row["state"] for row in result["partitions"]} == {
        DAYS[0]: "completed", DAYS[1]: "skipped", DAYS[2]: "skipped", DAYS[3]: "completed",
        "date=2026-11-05": "skipped"}
    children = _child_runs(state)
    assert sorted(run.name for run in children) == [f"batch-inference-{DAYS[0]}", f"batch-inference-{DAYS[3]}"]

    state = backfill(job, RANGE, reprocess="failed", max_active_runs=1, return_state=True)
    ran = [row["partition"] for row in state.result()["partitions"] if row["state"] == "completed"]
    assert ran == [DAYS[2]]
    assert _child_runs(state)[0].state.is_completed()

    rerun = backfill(job, RANGE, reprocess="none")  # idempotent: everything is done
    assert rerun["totals"] == {"skipped": 5}

    before = {day: _written_at(tmp_path, day) for day in DAYS}
    state = backfill(job, {"names": DAYS}, reprocess="completed", max_active_runs=2, return_state=True)
    assert state.result()["totals"] == {"completed": 4}
    assert all(_written_at(tmp_path, day).keys() == before[day].keys() for day in DAYS)
    assert all(_written_at(tmp_path, day)[k] != v for day in DAYS for k, v in before[day].items())
    children = _child_runs(state)
    assert len(children) == 4 and _max_overlap(children) <= 2  # the cap on partitions in flight


def test_a_failed_partition_fails_the_backfill_and_is_rerun_only_when_asked(tmp_path, make_job):
    write_sample_dataset(str(tmp_path / "in" / DAYS[0]), num_shards=1, rows_per_shard=2)
    write_rows(str(tmp_path / "in" / DAYS[1] / "bad.jsonl"), [{"no_prompt": 1}])
    job = make_job()
    state = backfill(job, {"names": DAYS[:2]}, return_state=True)
    assert state.is_failed()
    failure = state.result(raise_on_failure=False)
    assert isinstance(failure, BackfillFailed) and DAYS[1] in str(failure)
    assert {row["partition"]: row["state"] for row in failure.result["partitions"]} == {
        DAYS[0]: "completed", DAYS[1]: "failed"}

    plan = backfill(job, {"names": DAYS[:2]}, dry_run=True)["partitions"]
    assert plan[1]["status"] == "failed" and "last run failed" in plan[1]["reason"]
    assert backfill(job, {"names": DAYS[:2]})["totals"] == {"skipped": 2}  # reprocess=none leaves it
    write_rows(str(tmp_path / "in" / DAYS[1] / "bad.jsonl"), [{"prompt": "fixed"}])
    fixed = backfill(job, {"names": DAYS[:2]}, reprocess="failed")
    assert fixed["totals"] == {"skipped": 1, "completed": 1}


def test_deployment_runs_refuse_credentials_in_parameters(tmp_path, make_job):
    job = make_job(storage_options={"key": "k", "secret": "s"})
    with pytest.raises(DeploymentParameterError, match="work pool"):
        backfill(job, {"names": ["a"]}, deployment="batch-inference/nightly")


def test_backfill_over_partitions_on_seaweedfs(s3_server, make_job):
    prefix = s3_server.new_prefix()
    options = s3_server.storage_options()
    for day in DAYS[:3]:
        write_sample_dataset(f"s3://{prefix}/prompts/{day}", num_shards=2, rows_per_shard=2,
                             storage_options=options)
    job = make_job(input=f"s3://{prefix}/prompts", output=f"s3://{prefix}/outputs", storage_options=options)
    first = backfill(job, {"start": "2026-11-01", "end": "2026-11-02"}, max_active_runs=2)
    assert first["totals"] == {"completed": 2}
    plan = backfill(job, {"start": "2026-11-01", "end": "2026-11-03"}, dry_run=True)["partitions"]
    assert [(row["status"], row["action"]) for row in plan] == [
        ("completed", "skip"), ("completed", "skip"), ("never-run", "run")]
    second = backfill(job, {"start": "2026-11-01", "end": "2026-11-03"})
    assert second["totals"] == {"skipped": 2, "completed": 1}
    import s3fs

    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    for day in DAYS[:3]:
        assert len(fs.glob(f"{prefix}/outputs/{day}/_manifests/*.json")) == 2
        assert json.loads(fs.cat_file(f"{prefix}/outputs/_backfill/{day}.json"))["state"] == "completed"
