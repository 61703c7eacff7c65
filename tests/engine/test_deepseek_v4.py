"""DeepSeek-V4's attention (engine/model/adapters/deepseek_v4.py,
engine/attention/sparse_compressed.py): sliding-window layers, heavily compressed
layers (HCA) and compressed sparse layers (CSA) with their indexer; greedy tokens equal
transformers' through chunked prefill splitting compress blocks, preemption, prefix-cache
hits and decode.

The tiny model: a compress rate of 4 (CSA) and 8 (HCA), a window of 8 and an index top-k
of 3, so prompts of up to 41 tokens cross the window and rank up to 10 entries; sinks,
the hash router's token table and the compressors' position biases are random (their
defaults are zeros). Ties: 8 indexer heads, and every test records transformers' indexer
rows and asserts a gap at the top-k boundary (test_sparse_indexer.IndexerTies).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from shardline import LLM
from shardline.engine.attention.sparse_compressed import PooledSeries, pool_blocks, select_entries
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.support import model_support
from shardline.engine.model.tiny import build_tiny_model

from .hf_reference import assert_exact_through_preemption_and_hits, engine_greedy, random_prompts
from .test_sparse_indexer import _untied_greedy

INDEX_TOPK = 3
LAYERS = ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"]
CONFIG = dict(
    num_hidden_layers=3, hidden_size=64, num_attention_heads=4, head_dim=16, partial_rotary_factor=0.5,
    q_lora_rank=24, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=INDEX_TOPK,
    sliding_window=8, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    layer_types=LAYERS, mlp_layer_types=["hash_moe", "moe", "moe"], n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, hc_mult=2,
)


def _tiny_deepseek_v4(path: Path, **overrides) -> tuple[str, transformers.PreTrainedModel]:
    """The tiny checkpoint (with random sinks and hash table written in) and transformers'
    float32 eager load of it."""
    model_dir = build_tiny_model(path, "deepseek_v4", **{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(".sinks"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            elif name.endswith(".tid2eid"):
                tensor.copy_(torch.randint(0, model.config.n_routed_experts, tensor.shape, generator=generator))
    model.save_pretrained(model_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return str(model_dir), reference


def test_pooling_a_split_run_of_blocks_equals_pooling_it_whole():
    """A CSA entry pools the previous block's first half with its own second half: blocks
    pooled a few at a time (with the block before them read back) equal one pass."""
    torch.manual_seed(0)
    rate, width, blocks = 4, 6, 5
    kv, gate = torch.randn(blocks * rate, 2 * width), torch.randn(blocks * rate, 2 * width)
    bias = torch.randn(rate, 2 * width)
    whole = pool_blocks(kv, gate, bias, rate, 0, blocks, overlap=True)
    first = pool_blocks(kv[:2 * rate], gate[:2 * rate], bias, rate, 0, 2, overlap=True)
    rest = pool_blocks(kv[rate:], gate[rate:], bias, rate, 2, 3, overlap=True)
    assert torch.equal(torch.cat([first, rest]), whole)
    # block 0 has no previous block: its own half alone
    own = (kv[:rate, width:] * (gate[:rate, width:] + bias[:, width:]).softmax(0)).sum(0)
    torch.testing.assert_close(whole[0], own)
    assert PooledSeries(0, width, overlap=True).row_width == 5 * width


def test_selection_keeps_the_top_k_visible_entries():
    torch.manual_seed(1)
    rate, topk, entries = 4, 2, 5
    q, weights, keys = torch.randn(3, 2, 8), torch.rand(3, 2), torch.randn(entries, 8)
    positions = torch.tensor([6, 13, 19])  # 1, 3 and 5 visible entries
    selected = select_entries(q, weights, keys, positions, rate, topk, 0.5)
    scores = (torch.relu(q @ keys.T) * 0.5 * weights[:, :, None]).sum(1)
    assert selected[0].tolist() == [True, False, False, False, False]
    for row, visible in ((1, 3), (2, 5)):
        best = scores[row, :visible].topk(topk).indices
        assert sorted(selected[row].nonzero()[:, 0].tolist()) == sorted(best.tolist())


def test_deepseek_v4_equals_transformers_through_chunks_preemption_and_prefix_hits(tmp_path, monkeypatch):
    model_dir, reference = _tiny_deepseek_v4(tmp_path)
    assert model_support(reference.config, "generate").ok
    prompts = random_prompts(4, (2, 45), 512, seed=41, shared_prefix=21)
    expected = _untied_greedy(monkeypatch, reference, prompts, 8, INDEX_TOPK)
    assert len({tuple(tokens) for tokens in expected}) > 1  # the tokens depend on the prompt
    spec = KVCacheSpec.from_hf_config(reference.config, torch.float32)
    # one shared head; HCA rows: kv, gate, entry; CSA rows: (2 kv + 2 gate + entry) x (16 + 16)
    assert [(layer.num_kv_heads, layer.head_dim, layer.value_head_dim) for layer in spec.layers] == [
        (1, 16, 48), (1, 16, 160), (1, 16, 16)]
    # 7-token chunks split the compress blocks; a small cache makes requests preempt.
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=7, max_num_seqs=3,
              kv_cache_memory_bytes=5 * spec.bytes_per_block(16))
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    # The rerun: entries and projections come back with the blocks.
    assert_exact_through_preemption_and_hits(llm, prompts, expected, rerun=3)
    llm.close()


@pytest.mark.slow
def test_deepseek_v4_compressed_layers_alone_decode_past_many_blocks(tmp_path, monkeypatch):
    """Only compressed layers (no windowed group), long decodes: entries written by
    decode steps, one token at a time."""
    model_dir, reference = _tiny_deepseek_v4(
        tmp_path, num_hidden_layers=2, layer_types=LAYERS[:2], mlp_layer_types=["moe", "moe"])
    prompts = random_prompts(3, (5, 30), 512, seed=42)
    expected = _untied_greedy(monkeypatch, reference, prompts, 24, INDEX_TOPK)
    llm = LLM(model_dir, dtype="float32", max_num_seqs=3)
    assert engine_greedy(llm, prompts, 24) == expected
    llm.close()
