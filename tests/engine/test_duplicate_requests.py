"""Duplicate requests run once (engine/core/duplicates.py): every row gets the output it
would get alone (transformers' greedy tokens, the same seeded draws), under its own id
and in order, through preemption and aborts; sampled rows without a seed stay apart."""

from __future__ import annotations

import pytest
import torch

from shardline import LLM, SamplingParams
from shardline.engine.config import ConfigError, EngineConfig
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.loader import load_hf_config

from .hf_reference import hf_greedy, load_hf_model, random_prompts


def _completions(outputs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


def _block_bytes(model_dir: str) -> int:
    spec = KVCacheSpec.from_hf_config(load_hf_config(EngineConfig(model=model_dir)), torch.float64)
    return spec.bytes_per_block(16)


def _engine(llm: LLM) -> LLMEngine:
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    return engine


def _all_blocks_free(llm: LLM) -> bool:
    kv_cache = _engine(llm).scheduler.kv_cache
    return kv_cache.num_free_blocks == kv_cache.num_blocks


@pytest.mark.parametrize("prefix_aware_admission", [True, False])
def test_duplicate_rows_run_once_and_equal_rows_run_alone(tiny_llama_dir, prefix_aware_admission):
    distinct = random_prompts(5, (20, 70), 512, seed=31)
    assert len({tuple(p) for p in distinct}) == 5
    rows = [distinct[i] for i in (0, 1, 0, 2, 3, 0, 1, 4, 2, 0)]
    hf_model = load_hf_model(tiny_llama_dir)
    expected = {tuple(p): hf_greedy(hf_model, p, 24) for p in distinct}
    assert len({tuple(tokens) for tokens in expected.values()}) > 1  # the tokens depend on the prompt
    # A cache of 12 blocks for prompts of up to 5 blocks growing by 2: preemptions happen.
    llm = LLM(tiny_llama_dir, dtype="float64", max_num_batched_tokens=48, kv_cache_memory_bytes=12 * _block_bytes(
        tiny_llama_dir), prefix_aware_admission=prefix_aware_admission)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in rows], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [expected[tuple(p)] for p in rows]
    assert [o.request_id for o in outputs] == [str(i) for i in range(10)]
    assert sum(o.metrics.num_preemptions for o in outputs if o.metrics is not None and o.duplicate_of is None) > 0
    # Each distinct prompt ran once; the other five rows copied its output.
    assert [o.duplicate_of for o in outputs] == [None, None, "0", None, None, "0", "1", None, "3", "0"]
    assert _engine(llm).duplicates.num_collapsed == 5
    assert outputs[2].outputs[0].token_ids is not outputs[0].outputs[0].token_ids
    assert _all_blocks_free(llm) and _engine(llm).get_num_unfinished_requests() == 0


def test_seeded_duplicates_collapse_and_unseeded_samples_stay_independent(tiny_llama_dir):
    [prompt] = random_prompts(1, (30, 30), 512, seed=32)
    rows = [{"prompt_token_ids": prompt}] * 4
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = LLM(tiny_llama_dir, dtype="float64", collapse_duplicate_requests=False)
    want = alone.generate(rows[:1], seeded, use_tqdm=False)
    llm = LLM(tiny_llama_dir, dtype="float64")
    got = llm.generate(rows, [seeded, seeded, unseeded, unseeded], use_tqdm=False)
    assert _completions(got[:2]) == _completions(want) * 2
    assert [o.duplicate_of for o in got] == [None, "0", None, None]
    # Unseeded samples draw their own tokens (12 tokens at temperature 1: equal only by chance).
    assert got[2].outputs[0].token_ids != got[3].outputs[0].token_ids


def test_rows_differing_in_what_shapes_the_output_are_not_collapsed(tiny_llama_dir):
    [prompt] = random_prompts(1, (30, 30), 512, seed=33)
    llm = LLM(tiny_llama_dir, dtype="float64")
    engine = _engine(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    engine.add_request("a", {"prompt_token_ids": prompt}, greedy)
    engine.add_request("b", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=5))
    engine.add_request("c", {"prompt_token_ids": prompt}, greedy, priority=1)
    engine.add_request("d", {"prompt_token_ids": prompt + [5]}, greedy)
    engine.add_request("e", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2))
    assert engine.duplicates.num_collapsed == 0 and engine.get_num_unfinished_requests() == 5
    engine.add_request("f", {"prompt_token_ids": prompt}, greedy)
    assert engine.duplicates.num_collapsed == 1 and engine.get_num_unfinished_requests() == 6
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    assert sorted(outputs) == ["a", "b", "c", "d", "e", "f"]
    assert outputs["f"].duplicate_of == "a" and outputs["f"].outputs[0].token_ids == outputs["a"].outputs[0].token_ids


def test_aborting_one_duplicate_leaves_the_others_running(tiny_llama_dir):
    prompts = random_prompts(2, (40, 40), 512, seed=34)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    hf_model = load_hf_model(tiny_llama_dir)
    llm = LLM(tiny_llama_dir, dtype="float64")
    engine = _engine(llm)
    for request_id, prompt in (("lead", prompts[0]), ("x", prompts[0]), ("y", prompts[0]),
                               ("gone", prompts[1]), ("gone2", prompts[1])):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    engine.step()  # the two computations are running
    engine.abort_request(["lead", "x"])  # the computation goes on for "y"
    engine.abort_request(["gone2", "gone"])  # every row of the second is gone: it is aborted
    assert engine.get_num_unfinished_requests() == 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["y"]
    assert outputs[0].outputs[0].token_ids == hf_greedy(hf_model, prompts[0], 6)
    assert outputs[0].duplicate_of == "lead"
    assert _all_blocks_free(llm)
    # The aborted leader's id is free again, and a new identical request computes anew.
    engine.add_request("lead", {"prompt_token_ids": prompts[0]}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, o.duplicate_of) for o in outputs] == [("lead", None)]


def test_the_options_take_booleans_only():
    for name in ("prefix_aware_admission", "collapse_duplicate_requests"):
        with pytest.raises(ConfigError, match=f"{name} must be True or False, got 'yes'"):
            EngineConfig(model="m", **{name: "yes"})
