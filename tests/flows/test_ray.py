"""The batch flow on a local Ray cluster (CPU) started and stopped by the tests."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from shardline.flows.batch_inference import batch_inference
from shardline.flows.execution import Execution
from shardline.flows.ray_scale_out import shard_remote_options
from shardline.tasks.engine_cache import ENGINE_EVENTS_ENV
from shardline.tasks.sample_data import write_sample_dataset

ray = pytest.importorskip("ray")
pytest.importorskip("prefect_ray")


def _start_ray(events_path, **resources) -> None:
    # Workers inherit this process's environment when ray.init starts the cluster.
    os.environ[ENGINE_EVENTS_ENV] = str(events_path)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(object_store_memory=200 * 1024 * 1024, include_dashboard=False, log_to_driver=False,
             **resources)


@pytest.fixture
def cpu_cluster(tmp_path):
    """Two CPUs, no GPU: shard tasks ask for one CPU, so two worker processes run them."""
    events = tmp_path / "engine-events.jsonl"
    _start_ray(events, num_cpus=2)
    try:
        yield events
    finally:
        ray.shutdown()
        for name in (ENGINE_EVENTS_ENV, "RAY_AUTH_MODE"):
            os.environ.pop(name, None)


@pytest.fixture
def logical_gpu_cluster(tmp_path):
    """Two logical GPUs on a CPU machine: Ray assigns them and sets CUDA_VISIBLE_DEVICES per task."""
    events = tmp_path / "engine-events.jsonl"
    _start_ray(events, num_cpus=2, num_gpus=2)
    try:
        yield events
    finally:
        ray.shutdown()
        for name in (ENGINE_EVENTS_ENV, "RAY_AUTH_MODE"):
            os.environ.pop(name, None)


def _load_events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _outputs(directory) -> dict[str, list[dict]]:
    return {path.stem: pq.read_table(path).to_pylist() for path in sorted(directory.glob("*.parquet"))}


def test_shards_run_on_two_ray_workers_that_each_load_the_engine_once(cpu_cluster, tmp_path, make_job):
    write_sample_dataset(str(tmp_path / "in"), num_shards=8, rows_per_shard=4)
    # The flow's own process first: it builds the C kernels the workers then find built
    # (two workers starting together would each compile them).
    single = batch_inference(make_job(output=str(tmp_path / "single")))
    assert single["totals"]["done"] == 8
    driver_loads = len(_load_events(cpu_cluster))

    job = make_job(shards_in_flight=4)
    summary = batch_inference(job, Execution(task_runner="ray"))
    assert (summary["totals"]["done"], summary["totals"]["failed"]) == (8, 0)

    loads = _load_events(cpu_cluster)[driver_loads:]
    assert len({event["pid"] for event in loads}) == 2, loads  # two worker processes ran shards
    assert all(event["loads"] == 1 for event in loads) and len(loads) == 2, loads  # each loaded once
    assert os.getpid() not in {event["pid"] for event in loads}  # none in the flow's process
    manifests = sorted((tmp_path / "out" / "_manifests").glob("*.json"))
    assert [m.stem for m in manifests] == sorted(_outputs(tmp_path / "out"))
    assert len(manifests) == 8

    assert _outputs(tmp_path / "out") == _outputs(tmp_path / "single")

    again = batch_inference(job, Execution(task_runner="ray"))  # every shard is done exactly once
    assert (again["totals"]["skipped"], again["totals"]["done"]) == (8, 0)


@pytest.mark.slow
def test_one_engine_per_gpu_with_shards_spread_across_gpus(logical_gpu_cluster, tmp_path, make_job):
    write_sample_dataset(str(tmp_path / "in"), num_shards=6, rows_per_shard=3)
    summary = batch_inference(make_job(shards_in_flight=4), Execution(task_runner="ray"))
    assert summary["totals"]["done"] == 6
    loads = _load_events(logical_gpu_cluster)
    assert {event["binding"] for event in loads} == {"0", "1"}  # each task saw only the GPU Ray gave it
    by_process_and_gpu = {(event["pid"], event["binding"]) for event in loads}
    assert len(by_process_and_gpu) == len(loads)  # never two loads for one GPU in one process


def test_remote_options_ask_for_a_gpu_when_there_are_gpus_else_cpus():
    execution = Execution(task_runner="ray", gpus_per_shard=1, cpus_per_shard=2)
    assert shard_remote_options(execution, {"CPU": 16, "GPU": 8}) == {"num_gpus": 1, "max_calls": 0}
    assert shard_remote_options(execution, {"CPU": 16}) == {"num_cpus": 2, "max_calls": 0}
    no_reuse = Execution(task_runner="ray", reuse_ray_workers=False)
    assert shard_remote_options(no_reuse, {"GPU": 1})["max_calls"] == 1
