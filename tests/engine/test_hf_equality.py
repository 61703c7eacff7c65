"""Greedy tokens equal Hugging Face transformers' token for token (float64).

For every architecture shardline claims, with mixed prompt lengths (1 to 300),
batch sizes 1 and 32, a tiny token budget (chunked prefill), a tiny KV cache
(preemption) and shared prefixes (prefix-cache hits).
"""

from __future__ import annotations

import pytest
import torch

from shardline import LLM, SamplingParams
from shardline.engine.config import EngineConfig
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.loader import load_hf_config
from shardline.engine.model.tiny import TINY_ARCHS, build_tiny_model

from .hf_reference import hf_greedy, load_hf_model, random_prompts

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=TINY_ARCHS)
def arch_case(request, tmp_path_factory):
    """A tiny model of one architecture, its HF twin and reference outputs."""
    model_dir = str(build_tiny_model(tmp_path_factory.mktemp(request.param), request.param))
    hf_model = load_hf_model(model_dir)
    prompts = random_prompts(32, (1, 300), 512, seed=1)
    prompts[0] = prompts[0][:1]  # a one-token prompt
    expected = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    return request.param, model_dir, hf_model, prompts, expected


def _generate(model_dir, prompts, **engine_options):
    llm = LLM(model_dir, dtype="float64", **engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outputs


def test_batch_of_32_matches_hf(arch_case):
    _, model_dir, _, prompts, expected = arch_case
    _, outputs = _generate(model_dir, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_batch_of_1_matches_hf(arch_case):
    _, model_dir, _, prompts, expected = arch_case
    llm = LLM(model_dir, dtype="float64")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    for prompt, want in list(zip(prompts, expected))[:4]:
        [output] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert output.outputs[0].token_ids == want


def test_tiny_token_budget_chunks_prefill(arch_case):
    _, model_dir, _, prompts, expected = arch_case
    llm, outputs = _generate(model_dir, prompts[:8], max_num_batched_tokens=24, max_num_seqs=4)
    assert [o.outputs[0].token_ids for o in outputs] == expected[:8]


def test_tiny_kv_cache_preempts(arch_case):
    _, model_dir, _, prompts, expected = arch_case
    # 48 blocks of 16 tokens: far less than 32 prompts of up to 312 tokens need.
    hf_config = load_hf_config(EngineConfig(model=model_dir))
    per_block = KVCacheSpec.from_hf_config(hf_config, torch.float64).bytes_per_block(16)
    llm, outputs = _generate(model_dir, prompts, kv_cache_memory_bytes=48 * per_block)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(o.metrics.num_preemptions for o in outputs) > 0


def test_shared_prefix_hits_prefix_cache(arch_case):
    _, model_dir, hf_model, _, _ = arch_case
    prompts = random_prompts(6, (1, 40), 512, seed=7, shared_prefix=70)
    expected = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    llm = LLM(model_dir, dtype="float64")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    outputs = first + rest
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.num_cached_tokens >= 64 for o in rest)
