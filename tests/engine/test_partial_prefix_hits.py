"""Prefix hits that end inside a block (engine/core/partial_blocks.py): the copied slots
give every row transformers' greedy tokens and the tokens of the same rows with prefix
caching off, through chunked prompts, preemption, duplicates, async scheduling and both
admission orders; the runner's copy moves exactly the slots it is told to."""

from __future__ import annotations

import random

import pytest
import torch

from shardline import LLM, SamplingParams
from shardline.engine.config import EngineConfig
from shardline.engine.core.partial_blocks import BlockCopy
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.loader import load_hf_config

from .hf_reference import hf_greedy, load_hf_model

BLOCK_SIZE = 16


def _engine(llm: LLM) -> LLMEngine:
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    return engine


def _template_rows(seed: int, num_rows: int) -> list[list[int]]:
    """Rows of three templates whose lengths end inside a block, each row with a short
    tail of its own; some rows repeat an earlier row, some tails start alike."""
    rng = random.Random(seed)
    templates = [[rng.randrange(3, 512) for _ in range(length)] for length in (21, 37, 45)]
    rows: list[list[int]] = []
    for _ in range(num_rows):
        if rows and rng.random() < 0.2:
            rows.append(list(rng.choice(rows)))
        else:
            tail = [rng.randrange(3, 6) for _ in range(rng.randint(1, 12))]
            rows.append(rng.choice(templates) + tail)
    return rows


def _generate(llm: LLM, rows: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _num_partial_hits(llm: LLM) -> int:
    """Partial hits the cache committed: admissions whose hit does not end at a block boundary."""
    stats = _engine(llm).scheduler.kv_cache.stats
    return stats.num_partial_hits


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    rows = _template_rows(seed=41, num_rows=24)
    hf_model = load_hf_model(tiny_llama_dir)
    want = [hf_greedy(hf_model, row, 6) for row in rows]
    assert len({tuple(tokens) for tokens in want}) > 3  # the tokens depend on the rows
    return rows, want


@pytest.mark.parametrize("prefix_aware_admission", [True, False])
def test_partial_hits_equal_transformers_and_caching_off(tiny_llama_dir, expected, prefix_aware_admission):
    rows, want = expected
    llm = LLM(tiny_llama_dir, dtype="float64", block_size=BLOCK_SIZE, max_num_seqs=4,
              prefix_aware_admission=prefix_aware_admission)
    assert _generate(llm, rows, 6) == want
    assert _num_partial_hits(llm) > 0
    off = LLM(tiny_llama_dir, dtype="float64", block_size=BLOCK_SIZE, max_num_seqs=4, enable_prefix_caching=False)
    assert _generate(off, rows, 6) == want


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_partial_hits_through_chunks_and_preemption(tiny_llama_dir, expected, async_scheduling):
    rows, want = expected
    spec = KVCacheSpec.from_hf_config(load_hf_config(EngineConfig(model=tiny_llama_dir)), torch.float64)
    # 8 blocks of 16 for rows of up to 57 prompt tokens: rows preempt one another, and
    # 24-token chunks cut prompts across steps.
    llm = LLM(tiny_llama_dir, dtype="float64", block_size=BLOCK_SIZE, max_num_seqs=6, max_num_batched_tokens=24,
              kv_cache_memory_bytes=8 * spec.bytes_per_block(BLOCK_SIZE), collapse_duplicate_requests=False,
              async_scheduling=async_scheduling)
    assert _generate(llm, rows, 6) == want
    assert _num_partial_hits(llm) > 0
    assert _engine(llm).scheduler.num_preemptions > 0


def test_copy_block_prefixes_moves_only_the_named_slots(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float64", block_size=BLOCK_SIZE)
    runner = _engine(llm).runner
    for layer_caches in runner.kv_caches:
        for cache in layer_caches:
            cache.fill_(float("nan"))  # slots no request owns: a stray read shows
            cache[2].copy_(torch.randn_like(cache[2]))
            cache[5].copy_(torch.randn_like(cache[5]))
    before = [[cache.clone() for cache in layer_caches] for layer_caches in runner.kv_caches]
    # Block 5 is the first copy's destination and the second's source: the second gets
    # block 5 as it was before the step.
    runner.copy_block_prefixes([BlockCopy(2, 5, 3), BlockCopy(5, 7, 16)])
    for layer_caches, old in zip(runner.kv_caches, before):
        for cache, previous in zip(layer_caches, old):
            assert torch.equal(cache[5, :3], previous[2, :3])
            assert torch.equal(cache[5, 3:], previous[5, 3:])
            assert torch.equal(cache[7], previous[5])
            assert torch.equal(cache[2], previous[2])
            untouched = [block for block in range(cache.shape[0]) if block not in (2, 5, 7)]
            assert torch.isnan(cache[untouched]).all()
