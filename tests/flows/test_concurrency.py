"""A Prefect global concurrency limit caps shard tasks on engines across concurrent runs."""

from __future__ import annotations

import threading

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogHandler

from shardline.flows.batch_inference import ConcurrencyLimitMissing, batch_inference
from shardline.flows.execution import Execution
from shardline.tasks.sample_data import write_sample_dataset


def _slot_events(flow_run_ids) -> list[tuple]:
    """(time, +1 hold / -1 release, shard) from the runs' logs, releases first at equal times."""
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(flow_run_ids))))
    events = [(log.timestamp, 1 if " holds a slot" in log.message else -1, log.message.split()[1])
              for log in logs if " a slot of " in log.message or " its slot of " in log.message]
    return sorted(events, key=lambda event: (event[0], event[1]))


def test_two_concurrent_runs_never_hold_more_slots_than_the_limit(tmp_path, make_job):
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="test-gpus", limit=1))
    jobs = []
    for name in ("a", "b"):
        write_sample_dataset(str(tmp_path / f"in-{name}"), num_shards=3, rows_per_shard=3)
        jobs.append(make_job(input=str(tmp_path / f"in-{name}"), output=str(tmp_path / f"out-{name}"),
                             shards_in_flight=3))
    execution = Execution(gpu_concurrency_limit="test-gpus")
    states = [None, None]

    def run(index: int) -> None:
        states[index] = batch_inference(jobs[index], execution, return_state=True)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(state.is_completed() for state in states)
    assert [state.result()["totals"]["done"] for state in states] == [3, 3]

    events = _slot_events(state.state_details.flow_run_id for state in states)
    assert len(events) == 12  # 6 shards, each held once and released once
    held = peak = 0
    for _, step, _ in events:
        held += step
        peak = max(peak, held)
    assert peak == 1
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name("test-gpus").active_slots == 0


def test_a_missing_limit_is_named_before_any_shard_runs(tmp_path, make_job):
    write_sample_dataset(str(tmp_path / "in"), num_shards=1, rows_per_shard=1)
    state = batch_inference(make_job(), Execution(gpu_concurrency_limit="no-such-limit"), return_state=True)
    with pytest.raises(ConcurrencyLimitMissing, match="no-such-limit"):
        state.result()
    assert not (tmp_path / "out").exists()
