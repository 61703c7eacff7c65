"""Sparse- and compressed-attention models over tensor-parallel ranks: DeepSeek-V4 (one
shared key head, per-head sinks, a grouped output projection) and dots3_note (layers
with head counts of their own) on 2 gloo ranks give transformers' greedy tokens
(float32; 1 rank gives them in each model's own test, same options) through chunked
prefill, preemption and prefix hits; without ranks: each rank's heads, sinks and
output groups."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from shardline import LLM
from shardline.engine.model.adapters import adapt_attention
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.parallel.group import RankGroup, ShardingError
from shardline.engine.parallel.layers import RowParallelLinear
from shardline.engine.parallel.sharding import shard_model

from ..hf_reference import assert_exact_through_preemption_and_hits, random_prompts
from ..test_deepseek_v4 import CONFIG as DEEPSEEK_V4
from ..test_deepseek_v4 import INDEX_TOPK as DEEPSEEK_V4_TOPK
from ..test_deepseek_v4 import _tiny_deepseek_v4
from ..test_dots3_note import INDEX_TOPK as DOTS3_TOPK
from ..test_dots3_note import _tiny_dots3
from ..test_sparse_indexer import _untied_greedy
from .test_tensor_parallel import rank_processes

NO_COLLECTIVE = "no collective runs while splitting"


def two_ranks_exact(model_dir: str, prompts: list[list[int]], expected: list[list[int]], rerun: int,
                    **options) -> None:
    """2 ranks give ``expected`` (transformers' untied greedy tokens, which 1 rank gives in
    the model's own test with the same options) through preemption, then prefix hits."""
    llm = LLM(model_dir, tensor_parallel_size=2, dtype="float32", max_num_seqs=3, **options)
    processes = rank_processes(llm)
    try:
        assert_exact_through_preemption_and_hits(llm, prompts, expected, rerun=rerun)
    finally:
        llm.close()
    assert not any(process.is_alive() for process in processes)


@pytest.mark.slow
def test_deepseek_v4_on_two_ranks(tmp_path, monkeypatch):
    """Its sliding, CSA and HCA layers with half the heads (and sinks, output groups) per
    rank, the one key head, compressors and indexer whole; 7-token chunks, preemption."""
    model_dir, reference = _tiny_deepseek_v4(tmp_path)
    prompts = random_prompts(4, (2, 45), 512, seed=41, shared_prefix=21)
    expected = _untied_greedy(monkeypatch, reference, prompts, 8, DEEPSEEK_V4_TOPK)
    spec = KVCacheSpec.from_hf_config(reference.config, torch.float32)
    two_ranks_exact(model_dir, prompts, expected, 3, max_num_batched_tokens=7,
                    kv_cache_memory_bytes=5 * spec.bytes_per_block(16))


@pytest.mark.slow
def test_dots3_note_on_two_ranks(tmp_path, monkeypatch):
    """Its indexed layers' 4 heads and its sliding layer's 2 split by each layer's own
    count (the latents and index keys whole on each rank)."""
    model_dir, reference = _tiny_dots3(tmp_path)
    prompts = random_prompts(6, (2, 30), 512, seed=37, shared_prefix=21)
    expected = _untied_greedy(monkeypatch, reference, prompts, 8, DOTS3_TOPK)
    spec = KVCacheSpec.from_hf_config(reference.config, torch.float32)
    two_ranks_exact(model_dir, prompts, expected, 2, max_num_batched_tokens=16, max_model_len=64,
                    kv_cache_memory_bytes=6 * spec.bytes_per_block(16))


def test_deepseek_v4_ranks_hold_their_heads_sinks_and_output_groups(tmp_path):
    """4 heads and 2 output groups over 2 ranks: each rank's q_b_proj rows, sinks and
    o_a_proj block are its 2 heads' (one group), o_b_proj its group's columns; the one
    key head, the compressors and the indexer stay whole."""
    model_dir, whole = _tiny_deepseek_v4(tmp_path)
    for rank in (0, 1):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        adapt_attention(model)
        shard_model(model, RankGroup(rank, 2, lambda: NO_COLLECTIVE), num_attention_layers=3)
        for index in range(3):
            name = f"model.layers.{index}.self_attn"
            attention: Any = model.get_submodule(name)
            reference: Any = whole.get_submodule(name)
            original = attention.original  # the adapter's reference forward reads the same shares
            assert attention.o_groups == 1 and original.num_heads == 2 and original.config.o_groups == 1
            for module in (attention, original):
                assert torch.equal(module.sinks, reference.sinks[2 * rank: 2 * rank + 2])
            rows = int(DEEPSEEK_V4["o_lora_rank"])  # type: ignore[arg-type] - an int entry
            assert attention.o_a_proj.n_groups == 1
            assert torch.equal(attention.o_a_proj.weight, reference.o_a_proj.weight[rank * rows: (rank + 1) * rows])
            assert isinstance(attention.o_b_proj, RowParallelLinear)
            assert attention.kv_proj.weight.shape == reference.kv_proj.weight.shape
            if getattr(attention, "compressor", None) is not None:  # a sliding layer has none
                assert all(type(part) is type(original) for part, original in
                           zip(attention.compressor.modules(), reference.compressor.modules(), strict=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with pytest.raises(ShardingError, match="o_a_proj: its 2 output groups do not split over 4 ranks"):
        shard_model(model, RankGroup(0, 4, lambda: NO_COLLECTIVE), num_attention_layers=3)
