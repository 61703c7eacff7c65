"""An engine in a child process (engine_host=child): same rows as this process's own
engine, per-shard abort, and the child goes with close_engines(). (The host's shared
service is tested with the Airflow provider, tests/airflow/test_engine_service.py.)"""

from __future__ import annotations

import os
import pickle
import threading

import pytest

from shardline import LLM, PoolingParams, SamplingParams
from shardline.tasks import engine_cache
from shardline.tasks.engine_cache import EngineHost
from shardline.tasks.runner import RowRequest, RowResult, ShardAborted
from ..waiting import wait_for

OPTIONS = {"max_num_seqs": 4}


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


def test_child_engine_gives_the_rows_of_an_engine_in_this_process_and_goes_with_the_cache(tiny_model, caplog):
    rows = _rows(6, SamplingParams(max_tokens=5, temperature=0.0))
    own = engine_cache.get_runner(tiny_model, **OPTIONS).run_shard("shard-a", rows)
    child = engine_cache.get_runner(tiny_model, engine_host=EngineHost.CHILD, **OPTIONS)
    info = child.service_info()
    assert info["pid"] != os.getpid() and info["loads"] == 1
    served = child.run_shard("shard-a", rows)
    assert [result.index for result in served] == [row.index for row in rows]
    assert [r.output.outputs[0].token_ids for r in served] == [r.output.outputs[0].token_ids for r in own]
    assert engine_cache.get_runner(tiny_model, engine_host=EngineHost.CHILD, **OPTIONS) is child

    assert child.service_info()["driver"]["steps"] >= 6  # 5 tokens each, prefill included

    process = child._process
    with caplog.at_level("INFO", logger="shardline.tasks.engine_client"):
        engine_cache.close_engines()
    assert process.wait(timeout=60) == 0  # the child retired on its own when its stdin closed
    assert f"engine service pid {process.pid}: driver {{'steps': " in caplog.text
    with pytest.raises(Exception, match="closed"):
        child.run_shard("shard-b", rows)


def test_abort_stops_one_shard_in_the_child_and_another_shard_goes_on(tiny_model):
    child = engine_cache.get_runner(tiny_model, engine_host=EngineHost.CHILD, **OPTIONS)
    endless = _rows(8, SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True))
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            child.run_shard("long", endless)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    wait_for(lambda: child.service_info()["unfinished_requests"] > 0, "rows in the child's engine")
    assert child.abort_shard("long") and not child.abort_shard("never-submitted")
    worker.join(timeout=120)
    assert len(outcome) == 1 and isinstance(outcome[0], ShardAborted)
    assert "shard long was aborted" in str(outcome[0])  # the client's key, not the service's id
    assert child.service_info()["unfinished_requests"] == 0
    short = child.run_shard("short", _rows(2, SamplingParams(max_tokens=2, temperature=0.0)))
    assert [len(result.output.outputs[0].token_ids) for result in short] == [2, 2, 2]
