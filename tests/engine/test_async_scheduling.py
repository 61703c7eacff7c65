"""Async scheduling on CPU: the step in flight leaves each of its sequences one
pending token, which the next step computes before the host appends it. Tokens,
texts, finish reasons and stop reasons must equal the synchronous engine's (and
transformers' greedy tokens), through chunked prefill, preemption, aborts, n > 1,
seeds, stop strings and max_tokens; a token computed past a stop is discarded and
every KV block comes back."""

from __future__ import annotations

import pytest
import torch

from shardline import LLM, SamplingParams
from shardline.engine.config import ConfigError, EngineConfig
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.loader import load_hf_config

from .hf_reference import hf_greedy, load_hf_model, random_prompts


def _completions(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def _all_blocks_free(llm: LLM) -> bool:
    kv_cache = llm.llm_engine.scheduler.kv_cache
    return kv_cache.num_free_blocks == kv_cache.num_blocks


def test_async_greedy_matches_hf_under_chunking_and_preemption(tiny_llama_dir):
    prompts = random_prompts(10, (1, 120), 512, seed=11)
    hf_model = load_hf_model(tiny_llama_dir)
    expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    per_block = KVCacheSpec.from_hf_config(load_hf_config(EngineConfig(model=tiny_llama_dir)),
                                           torch.float64).bytes_per_block(16)
    llm = LLM(tiny_llama_dir, dtype="float64", async_scheduling=True, max_num_batched_tokens=40,
              kv_cache_memory_bytes=14 * per_block)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=10),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert llm.llm_engine.num_deferred_steps > 0
    assert _all_blocks_free(llm)


def test_async_equals_sync_with_seeds_forks_stops_and_lengths(tiny_llama_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, (3, 40), 512, seed=12)]
    sync = LLM(tiny_llama_dir, dtype="float64", async_scheduling=False, max_num_seqs=5)
    free_run = sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                             use_tqdm=False)
    # Stop strings cut from the middle of what each prompt generates, so they do stop it.
    stops = [o.outputs[0].text[6:8] for o in free_run]
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]) for stop in stops[:4]]
    params += [
        SamplingParams(temperature=0.9, seed=5, max_tokens=13, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, seed=6, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[free_run[6].outputs[0].token_ids[4]]),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    want = sync.generate(prompts, params, use_tqdm=False)
    assert sum(o.outputs[0].stop_reason is not None for o in want) >= 4  # the stops did stop them
    llm = LLM(tiny_llama_dir, dtype="float64", async_scheduling=True, max_num_seqs=5)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _completions(got) == _completions(want)
    assert llm.llm_engine.num_deferred_steps > 0
    assert _all_blocks_free(llm)


def test_async_abort_of_a_request_in_flight(tiny_llama_dir):
    prompts = random_prompts(4, (5, 30), 512, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sync = LLM(tiny_llama_dir, dtype="float64", async_scheduling=False)
    want = {o.request_id: o.outputs[0].token_ids
            for o in sync.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)}
    llm = LLM(tiny_llama_dir, dtype="float64", async_scheduling=True)
    engine = llm.llm_engine
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    for _ in range(4):
        assert engine.step() == []
    assert engine._in_flight is not None and engine._in_flight.deferred  # "1" has a token pending
    engine.abort_request("1")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    engine.step()  # the last step in flight: its rows are all finished, so discarded
    assert finished == {key: want[key] for key in ("0", "2", "3")}
    assert _all_blocks_free(llm) and engine.scheduler.get_num_unfinished_requests() == 0


def test_async_steps_are_synchronous_for_sequences_that_need_their_tokens(tiny_llm, tiny_llama_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, (3, 20), 512, seed=14)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, repetition_penalty=1.3)
    llm = LLM(tiny_llama_dir, dtype="float64", async_scheduling=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.num_deferred_steps == 0
    want = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert _completions(got) == _completions(want)


def test_async_scheduling_option():
    assert EngineConfig(model="m").async_scheduling is None
    with pytest.raises(ConfigError, match="async_scheduling must be True, False or None, got 'yes'"):
        EngineConfig(model="m", async_scheduling="yes")
