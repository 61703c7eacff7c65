"""The client of the host's shared engine service, a ShardExecutor like this process's own
runner: the same rows, per-shard abort. (Sharing one service between task processes,
idle retirement and stale sockets are tested with the Airflow provider,
tests/airflow/test_engine_service.py.)"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import pytest

from shardline import LLM, PoolingParams, SamplingParams
from shardline.tasks import engine_cache
from shardline.tasks.engine_cache import EngineHost
from shardline.tasks.engine_client import ServiceClient, _is_engine_service
from shardline.tasks.executor import RowRequest, RowResult, ShardAborted, ShardExecutor

from ..waiting import wait_for

OPTIONS = {"max_num_seqs": 4}


@pytest.fixture
def service(monkeypatch, tiny_model):
    """A client of a shared service in a private runtime directory; the service is stopped after."""
    monkeypatch.setenv("SHARDLINE_RUNTIME_DIR", tempfile.mkdtemp(prefix="sl-run-"))  # short: socket paths
    client = engine_cache.get_executor(tiny_model, EngineHost.SERVICE, **OPTIONS)
    assert isinstance(client, ServiceClient) and isinstance(client, ShardExecutor)
    pid = client.service_info()["pid"]
    yield client
    engine_cache.close_engines()
    os.kill(pid, signal.SIGTERM)  # it retires cleanly, removing its files
    wait_for(lambda: not _is_engine_service(pid), "the service to retire")
    assert not client.files.sock.exists() and not Path(client.files.key).exists()


def _rows(count: int, params: SamplingParams) -> list[RowRequest]:
    rows = [RowRequest(index, f"Row {index} says", None, params) for index in range(count)]
    rows.append(RowRequest(count, None, [{"role": "user", "content": "Hi there"}], params))
    return rows


def test_rows_and_results_cross_a_process_boundary_intact(tiny_model):
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, seed=7, stop=["zz"])
    request = RowRequest(3, "Hello", None, params, priority=2)
    assert pickle.loads(pickle.dumps(request)) == request
    assert pickle.loads(pickle.dumps(PoolingParams(normalize=True, dimensions=8))) == \
        PoolingParams(normalize=True, dimensions=8)
    llm = LLM(tiny_model, **OPTIONS)
    try:
        [output] = llm.generate(["Hello"], params, use_tqdm=False)
    finally:
        llm.close()
    result = pickle.loads(pickle.dumps(RowResult(3, output=output)))
    assert result.output.outputs[0].token_ids == output.outputs[0].token_ids
    assert result.output.outputs[0].logprobs == output.outputs[0].logprobs


def test_service_gives_the_rows_of_an_engine_in_this_process(service, tiny_model):
    rows = _rows(6, SamplingParams(max_tokens=5, temperature=0.0))
    own = engine_cache.get_executor(tiny_model, **OPTIONS).run_shard("shard-a", rows)
    info = service.service_info()
    assert info["pid"] != os.getpid() and info["loads"] == 1
    served = service.run_shard("shard-a", rows)
    assert [result.index for result in served] == [row.index for row in rows]
    assert [r.output.outputs[0].token_ids for r in served] == [r.output.outputs[0].token_ids for r in own]
    assert engine_cache.get_executor(tiny_model, EngineHost.SERVICE, **OPTIONS) is service
    assert service.service_info()["driver"]["steps"] >= 6  # 5 tokens each, prefill included
    service.close()
    with pytest.raises(Exception, match="closed"):
        service.run_shard("shard-b", rows)


def test_abort_stops_one_shard_on_the_service_and_another_shard_goes_on(service):
    endless = _rows(8, SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True))
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            service.run_shard("long", endless)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    wait_for(lambda: service.service_info()["unfinished_requests"] > 0, "rows in the service's engine")
    assert service.abort_shard("long") and not service.abort_shard("never-submitted")
    worker.join(timeout=120)
    assert len(outcome) == 1 and isinstance(outcome[0], ShardAborted)
    assert "shard long was aborted" in str(outcome[0])  # the client's key, not the service's id
    assert service.service_info()["unfinished_requests"] == 0
    short = service.run_shard("short", _rows(2, SamplingParams(max_tokens=2, temperature=0.0)))
    assert [len(result.output.outputs[0].token_ids) for result in short] == [2, 2, 2]


def test_a_service_whose_runtime_directory_was_removed_still_retires_on_sigterm(monkeypatch, tiny_model):
    """A runtime directory removed under a running service (a temporary directory cleaned
    up, a test's tmp dir deleted) leaves no process behind: SIGTERM still retires it."""
    runtime = tempfile.mkdtemp(prefix="sl-run-")
    monkeypatch.setenv("SHARDLINE_RUNTIME_DIR", runtime)
    client = engine_cache.get_executor(tiny_model, EngineHost.SERVICE, **OPTIONS)
    assert isinstance(client, ServiceClient)
    pid = client.service_info()["pid"]
    engine_cache.close_engines()
    shutil.rmtree(runtime)
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not _is_engine_service(pid), "the service to retire")
