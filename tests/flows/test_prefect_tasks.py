"""The thin Prefect tasks the flows use, composed inside a tiny flow, on memory://."""

from __future__ import annotations

import uuid

import fsspec
import pyarrow.parquet as pq
from prefect import flow

from shardline.tasks.prefect_tasks import completed_manifests_task, preflight_task, process_shard_task
from shardline.tasks.sample_data import write_sample_dataset


@flow
def shard_by_shard(job):
    shards = preflight_task(job)
    assert completed_manifests_task(shards, job) == [None] * len(shards)
    manifests = [process_shard_task(shard, job) for shard in shards]
    assert completed_manifests_task(shards, job) == manifests
    return manifests


def test_tasks_compose_in_a_flow_on_memory_storage(make_job):
    prefix = f"memory://tasks-{uuid.uuid4().hex}"
    write_sample_dataset(f"{prefix}/in", num_shards=2, rows_per_shard=2)
    job = make_job(input=f"{prefix}/in", output=f"{prefix}/out")
    manifests = shard_by_shard(job)
    assert [m.rows for m in manifests] == [3, 3] and [m.errors for m in manifests] == [1, 1]
    fs = fsspec.filesystem("memory")
    with fs.open(f"{prefix}/out/part-00001.parquet".removeprefix("memory://"), "rb") as handle:
        assert pq.read_table(handle).column("id").to_pylist() == ["s01-000", "s01-bad", "s01-001"]
    assert manifests[0].output.startswith("memory://") and manifests[0].output.endswith("out/part-00000.parquet")
