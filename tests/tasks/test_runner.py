"""The shard runner on a real (tiny) engine: streaming shards from many threads,
per-row refusals, and a poison row isolated by bisection."""

from __future__ import annotations

import threading
import time

import pytest

from shardline import LLM, SamplingParams
from shardline.tasks.executor import RowRequest, ShardAborted
from shardline.tasks.runner import RetryPolicy, ShardRunner

GREEDY = SamplingParams(max_tokens=5, temperature=0.0)


def _requests(prompts, params=GREEDY):
    return [RowRequest(index=i, prompt=p, messages=None, params=params) for i, p in enumerate(prompts)]


def _prompts(shard: int, num: int) -> list[str]:
    return [f"Shard {shard} row {row}: the quick brown fox" for row in range(num)]


@pytest.fixture
def llm(tiny_model):
    engine = LLM(tiny_model, max_num_seqs=8, seed=0)
    yield engine
    engine.close()


def _scheduled_shards_per_step(llm) -> list[set[str]]:
    """Record which shards each engine step computes (observes, changes nothing)."""
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule
    steps: list[set[str]] = []

    def observed_schedule():
        output = schedule()
        steps.append({item.request.request_id.split("@")[0] for item in output.scheduled})
        return output

    scheduler.schedule = observed_schedule
    return steps


def test_shards_from_many_threads_share_one_batch_and_match_generate(llm, tiny_model):
    runner = ShardRunner(llm, max_queued=12)
    steps = _scheduled_shards_per_step(llm)
    results: dict[int, list] = {}

    def run(shard: int) -> None:
        results[shard] = runner.run_shard(f"shard{shard}", _requests(_prompts(shard, 7)))

    threads = [threading.Thread(target=run, args=(shard,)) for shard in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    runner.close()
    assert not llm.llm_engine.has_unfinished_requests()
    assert any(len(shards) > 1 for shards in steps), "no step mixed rows of two shards"
    stats = runner.stats()
    assert stats["steps"] == len(steps)  # every engine step the driver took, counted once
    assert 0 < stats["step_seconds"] <= stats["active_seconds"]

    reference = LLM(tiny_model, max_num_seqs=8, seed=0)
    for shard in range(4):
        expected = reference.generate(_prompts(shard, 7), GREEDY, use_tqdm=False)
        assert [r.index for r in results[shard]] == list(range(7))
        assert all(r.error is None for r in results[shard])
        assert [r.output.outputs[0].token_ids for r in results[shard]] == [e.outputs[0].token_ids for e in expected]
    reference.close()


def test_shards_with_the_same_key_at_once_never_share_a_request_id(llm):
    """Partitions whose files share a stem (date=1/part-0, date=2/part-0) run at the
    same time under one key each: every row of both completes, none refused as a
    duplicate id."""
    runner = ShardRunner(llm, max_queued=12)
    results: dict[int, list] = {}

    def run(partition: int) -> None:
        results[partition] = runner.run_shard("part-00000", _requests(_prompts(partition, 6)))

    threads = [threading.Thread(target=run, args=(partition,)) for partition in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    runner.close()
    for partition in range(2):
        assert [r.index for r in results[partition]] == list(range(6))
        assert [r.error for r in results[partition]] == [None] * 6


def test_rows_the_engine_refuses_become_errors(llm):
    runner = ShardRunner(llm)
    rows = _requests(["fine prompt", "", "word " * 2000, "another fine prompt"])
    results = runner.run_shard("s", rows)
    runner.close()
    assert [r.error is None for r in results] == [True, False, False, True]
    assert "empty" in results[1].error
    assert "'s@1:2'" in results[2].error and "max_model_len" in results[2].error
    assert results[3].output.outputs[0].finish_reason == "length"


def test_poison_row_is_isolated_by_bisection_and_the_rest_complete(llm):
    tokenizer = llm.get_tokenizer()
    poison_id = tokenizer.convert_tokens_to_ids("<|system|>")
    seen_poison = []

    def fail_on_poison(module, args):
        if (args[0] == poison_id).any():
            seen_poison.append(1)
            raise RuntimeError("device fault while computing the batch")

    handle = llm.llm_engine.model.get_input_embeddings().register_forward_pre_hook(fail_on_poison)
    prompts = [f"row {i} about the sea" for i in range(10)]
    prompts[6] = "<|system|> poisoned row"
    runner = ShardRunner(llm, retry=RetryPolicy(base_delay=0.001, max_delay=0.01))
    try:
        results = runner.run_shard("p", _requests(prompts))
    finally:
        runner.close()
        handle.remove()
    assert [r.error is None for r in results] == [i != 6 for i in range(10)]
    assert "device fault while computing the batch" in results[6].error
    assert "isolated by bisection" in results[6].error
    assert len(seen_poison) >= 3  # the batch, its halves, then the row alone (and one retry)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.scheduler.get_num_unfinished_requests() == 0

    clean = ShardRunner(llm)
    again = clean.run_shard("p2", _requests([p for i, p in enumerate(prompts) if i != 6]))
    clean.close()
    expected = [r.output.outputs[0].token_ids for i, r in enumerate(results) if i != 6]
    assert [r.output.outputs[0].token_ids for r in again] == expected


def test_closed_runner_refuses_work(llm):
    runner = ShardRunner(llm)
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner.run_shard("s", _requests(["x"]))


def test_abort_shard_drops_its_rows_and_the_other_shards_go_on(llm):
    runner = ShardRunner(llm, max_queued=4)
    endless = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    outcome: dict[str, object] = {}

    def run(key: str, rows) -> None:
        try:
            outcome[key] = runner.run_shard(key, rows)
        except Exception as exc:
            outcome[key] = exc

    slow = threading.Thread(target=run, args=("slow", _requests(_prompts(0, 10), endless)))
    slow.start()
    while not llm.llm_engine.has_unfinished_requests():
        time.sleep(0.01)
    quick = threading.Thread(target=run, args=("quick", _requests(_prompts(1, 3))))
    quick.start()
    assert runner.abort_shard("slow")
    slow.join(timeout=60)
    quick.join(timeout=60)
    assert not slow.is_alive() and not quick.is_alive()
    assert isinstance(outcome["slow"], ShardAborted)
    assert [r.error is None for r in outcome["quick"]] == [True, True, True]
    assert not llm.llm_engine.has_unfinished_requests()
    assert not runner.abort_shard("slow") and not runner.abort_shard("never-ran")
    runner.close()
