"""Two CPU engine replicas fed from one row queue (tasks/data_parallel.py): the same results as
one engine, in order, with per-row errors; a replica killed with SIGKILL fails only the shards
it held rows of, naming it, and comes back; nothing is left running after close. The host's
engine service (what the Airflow operator uses) runs replicas the same way."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time

import pytest
import torch

from shardline import SamplingParams
from shardline.cli import build_parser, job_from_args, main
from shardline.tasks.data_parallel import DataParallelRunner
from shardline.tasks.engine_cache import EngineHost, get_executor, load_runner
from shardline.tasks.engine_client import ServiceClient
from shardline.tasks.executor import RowRequest, RowResult, RunnerError, ShardAborted
from shardline.tasks.fingerprint import fingerprint, fingerprint_fields
from shardline.tasks.preflight import PreflightFailed, preflight
from shardline.tasks.process_tree import command_line, descendants, is_alive
from shardline.tasks.replicas import plan_placements
from shardline.tasks.sample_data import write_sample_dataset
from shardline.tasks.storage import Shard

OPTIONS = {"max_num_seqs": 4, "max_model_len": 96, "device": "cpu"}
TOPICS = ("the sea", "a paged cache", "Tokyo", "two plus two", "bonjour", "object storage", "the lazy dog")


def _shard_rows(shard: int, count: int, max_tokens: int = 6) -> list[RowRequest]:
    rows = []
    for index in range(count):
        prompt = f"Shard {shard} row {index}: one line about {TOPICS[(shard * 3 + index) % len(TOPICS)]}."
        if index == 3:
            prompt = "far too long " * 60  # over max_model_len: the engine refuses it, an error row
        rows.append(RowRequest(index, prompt, None, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True)))
    return rows


def _view(results: list[RowResult]) -> list[tuple[int, tuple[int, ...] | None, bool]]:
    """What a shard's output is made of: the row, its tokens, whether it failed."""
    return [(r.index, tuple(r.output.outputs[0].token_ids) if r.output is not None else None,  # type: ignore[union-attr]
             r.error is not None) for r in results]


def _run_concurrently(executor, shards: dict[str, list[RowRequest]]) -> dict[str, list[RowResult] | BaseException]:
    outcomes: dict[str, list[RowResult] | BaseException] = {}

    def run(key: str) -> None:
        try:
            outcomes[key] = executor.run_shard(key, shards[key])
        except BaseException as exc:
            outcomes[key] = exc

    threads = [threading.Thread(target=run, args=(key,)) for key in shards]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return outcomes


@pytest.fixture(scope="module")
def replicated(tiny_model):
    runner = DataParallelRunner(tiny_model, OPTIONS, 2)
    yield runner
    pids = runner.replica_pids()
    runner.close()
    assert not any(pid is not None and is_alive(pid) for pid in pids), "a replica outlived close()"


@pytest.fixture(scope="module")
def reference(tiny_model):
    """One engine in this process over the same shards: what the replicas must reproduce."""
    runner = load_runner(tiny_model, OPTIONS)
    shards = {f"part-{i}": _shard_rows(i, 10) for i in range(3)}
    yield {key: _view(results) for key, results in _run_concurrently(runner, shards).items()}  # type: ignore[arg-type]
    runner.close()
    runner.llm.close()


def test_placement_shares_cpu_threads_and_refuses_missing_devices():
    placements = plan_placements(2, {"device": "cpu"})
    assert [p.cuda_devices for p in placements] == [None, None]
    assert all(p.threads == max(1, len(os.sched_getaffinity(0)) // 2) for p in placements)
    with pytest.raises(ValueError, match="data_parallel_size must be 1 or more, got 0"):
        plan_placements(0, {})


def test_the_option_reaches_the_job_from_the_command_line_and_stays_out_of_the_fingerprint(tiny_model, capsys):
    args = build_parser().parse_args(["run", "in", "out", "--model", tiny_model, "--data-parallel-size", "2"])
    job = job_from_args(args)
    assert job.data_parallel_size == 2
    shard = Shard("in/part-0.parquet", "part-0", "parquet", 10)
    one = job.model_copy(update={"data_parallel_size": 1})
    assert fingerprint(fingerprint_fields(job, shard, {})) == fingerprint(fingerprint_fields(one, shard, {}))
    assert main(["run", "in", "out", "--model", tiny_model, "--data-parallel-size", "0"]) == 2
    assert capsys.readouterr().err.strip() == "shardline run: --data-parallel-size must be >= 1, got 0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusing CUDA replicas needs a host without CUDA")
def test_preflight_refuses_cuda_replicas_on_a_host_without_cuda(tmp_path, make_job):
    write_sample_dataset(str(tmp_path / "in"), num_shards=1, rows_per_shard=2)
    job = make_job(data_parallel_size=2, engine_options={"device": "cuda"})
    with pytest.raises(PreflightFailed, match=r"data_parallel_size=2 with device='cuda': no CUDA device is visible"):
        preflight(job)


def test_two_replicas_give_one_engines_results_in_order(replicated, reference):
    shards = {f"part-{i}": _shard_rows(i, 10) for i in range(3)}
    outcomes = _run_concurrently(replicated, shards)
    assert {key: _view(results) for key, results in outcomes.items()} == reference  # type: ignore[arg-type]
    failed = outcomes["part-0"][3]  # type: ignore[index]
    assert failed.error is not None and "96" in failed.error  # the engine's refusal, naming the limit
    assert len({row[1] for rows in reference.values() for row in rows if row[1]}) > 20  # outputs differ by input
    assert all(stats["requests_added"] > 0 for stats in replicated.replica_stats()), "a replica idled"
    heard: list[int] = []
    replicated.run_shard("part-0", _shard_rows(0, 10), on_row=lambda done: heard.append(done.index))
    assert sorted(heard) == list(range(10))  # progress hears of every row once, whichever replica ran it


def test_aborting_a_shard_leaves_the_others_running(replicated):
    shards = {f"part-{i}": _shard_rows(i, 10, max_tokens=40) for i in range(2)}
    outcomes: dict[str, object] = {}
    thread = threading.Thread(target=lambda: outcomes.update(_run_concurrently(replicated, shards)))
    thread.start()
    _wait_for(lambda: replicated.unfinished_requests() > 0)
    assert replicated.abort_shard("part-0")
    thread.join(timeout=300)
    assert isinstance(outcomes["part-0"], ShardAborted)
    assert len(outcomes["part-1"]) == 10  # type: ignore[arg-type]


def test_a_replica_killed_mid_shard_fails_its_shards_naming_it_and_comes_back(replicated, reference):
    shards = {f"part-{i}": _shard_rows(i, 10, max_tokens=40) for i in range(2)}
    outcomes: dict[str, object] = {}
    thread = threading.Thread(target=lambda: outcomes.update(_run_concurrently(replicated, shards)))
    thread.start()
    _wait_for(lambda: all(rows > 0 for rows in replicated.rows_outstanding()))  # rows on both replicas
    victim = replicated.replica_pids()[1]
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=300)
    failures = [outcome for outcome in outcomes.values() if isinstance(outcome, RunnerError)]
    assert failures, outcomes
    assert all(f"data-parallel replica 1 (pid {victim}) ended (killed by SIGKILL)" in str(f) for f in failures)
    _wait_for(lambda: None not in replicated.replica_pids(), timeout=240)  # restarted
    assert replicated.replica_pids()[1] != victim and not is_alive(victim)
    again = _run_concurrently(replicated, {f"part-{i}": _shard_rows(i, 10) for i in range(3)})
    assert {key: _view(results) for key, results in again.items()} == reference  # type: ignore[arg-type]


def _wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.slow
def test_the_engine_service_runs_replicas_too_and_takes_them_when_it_retires(monkeypatch, tiny_model, reference):
    monkeypatch.setenv("SHARDLINE_RUNTIME_DIR", tempfile.mkdtemp(prefix="sl-dp-"))  # short: socket paths
    client = get_executor(tiny_model, EngineHost.SERVICE, 2, **OPTIONS)  # what the Airflow operator asks
    assert isinstance(client, ServiceClient)
    pid = client.service_info()["pid"]
    replicas = [child for child in descendants(pid) if "shardline.tasks.replica" in command_line(child)]
    assert len(replicas) == 2
    outcomes = _run_concurrently(client, {f"part-{i}": _shard_rows(i, 10) for i in range(3)})
    assert {key: _view(results) for key, results in outcomes.items()} == reference  # type: ignore[arg-type]
    assert client.service_info()["driver"]["requests_added"] >= 27
    os.kill(pid, signal.SIGTERM)  # the service retires, closing its replicas
    _wait_for(lambda: not any(is_alive(p) for p in [pid, *replicas]), timeout=60)


def test_with_every_replica_dead_and_no_restart_left_shards_fail_instead_of_waiting(tiny_model):
    runner = DataParallelRunner(tiny_model, OPTIONS, 1, max_restarts=0)
    try:
        outcomes: dict[str, object] = {}
        thread = threading.Thread(target=lambda: outcomes.update(
            _run_concurrently(runner, {"part-0": _shard_rows(0, 10, max_tokens=40)})))
        thread.start()
        _wait_for(lambda: runner.unfinished_requests() > 0)
        [pid] = runner.replica_pids()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        thread.join(timeout=120)
        assert isinstance(outcomes["part-0"], RunnerError) and "killed by SIGKILL" in str(outcomes["part-0"])
        with pytest.raises(RunnerError, match="every data-parallel replica of .* has died and none restarted"):
            runner.run_shard("part-1", _shard_rows(1, 2))
    finally:
        runner.close()
