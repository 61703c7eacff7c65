"""A tensor-parallel engine whose rank died is not kept: its shard fails whole (no row
is blamed), and the shard's retry gets a newly loaded engine from the engine cache and
completes with the tokens the first engine gave."""

from __future__ import annotations

import os
import signal

import pytest

from shardline import SamplingParams
from shardline.engine.model.tiny import build_tiny_model
from shardline.tasks import engine_cache
from shardline.tasks.executor import RowRequest, RunnerError

from .test_tensor_parallel import OPTIONS, rank_processes

PROMPTS = ["hello there", "a b c d e", "the quick brown fox", "one two"]


def rows() -> list[RowRequest]:
    params = SamplingParams(max_tokens=8, temperature=0)
    return [RowRequest(index=i, prompt=prompt, messages=None, params=params) for i, prompt in enumerate(PROMPTS)]


def tokens(runner: engine_cache.ShardRunner, key: str) -> list[list[int]]:
    results = runner.run_shard(key, rows())
    assert all(result.error is None and result.output is not None for result in results), results
    return [list(result.output.outputs[0].token_ids) for result in results]  # type: ignore[union-attr]


def test_a_shard_retried_after_a_rank_was_killed_completes(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    try:
        runner = engine_cache.get_runner(model_dir, tensor_parallel_size=2, **OPTIONS)
        expected = tokens(runner, "shard-0")
        assert len({tuple(row) for row in expected}) > 1  # the tokens depend on the prompt
        processes = rank_processes(runner.llm)
        rank = processes[0]
        os.kill(rank.pid, signal.SIGKILL)
        rank.join(30)
        with pytest.raises(RunnerError, match=f"rank 1 \\(pid {rank.pid}\\) exited with code -9"):
            runner.run_shard("shard-1", rows())  # the whole shard fails: no row is an error row
        retried = engine_cache.get_runner(model_dir, tensor_parallel_size=2, **OPTIONS)
        assert retried is not runner
        assert tokens(retried, "shard-1") == expected
        key = engine_cache.engine_key(model_dir, dict(tensor_parallel_size=2, **OPTIONS))
        assert engine_cache.engine_loads()[key] == 2
        assert not any(process.is_alive() for process in processes)  # the dead engine's ranks stopped
    finally:
        engine_cache.close_engines()
