"""Qwen4-exp's query-sparse attention (engine/model/adapters/qwen4_exp.py) beside its
gated delta-net layers: greedy tokens equal transformers' through chunked prefill
splitting the indexer's blocks, preemption, prefix-cache hits and decode.

The tiny model: blocks of 4 tokens and a budget of 8 (each query attends its 2 best
blocks plus the tokens after its last whole block), so prompts of up to 64 tokens rank
up to 16 blocks. Ties: 8 index heads, and the test records every block ranking
transformers' indexer makes and asserts a gap at the top-k boundary.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.adapters.qwen4_exp import block_selection
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.support import model_support
from shardline.engine.model.tiny import build_tiny_model, tiny_config

from .coverage import tiny_overrides
from .hf_reference import assert_exact_through_preemption_and_hits, hf_greedy, random_prompts

BLOCK_TOPK = 2


class BlockTies:
    """Records, while active, the gap between the k-th and the next score of every block
    ranking (``Tensor.topk`` over one query's block scores, k = BLOCK_TOPK)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gaps: list[float] = []
        original = torch.Tensor.topk

        def recording(tensor: torch.Tensor, k: int, *args, **kwargs):
            if tensor.dim() == 1 and k == BLOCK_TOPK and tensor.numel() > k:
                best = original(tensor, k + 1).values
                self.gaps.append(float(best[k - 1] - best[k]))
            return original(tensor, k, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "topk", recording)


def _tiny_qwen4_exp(tmp_path) -> tuple[str, transformers.PreTrainedModel]:
    overrides = {**tiny_overrides("qwen4_exp_text"), "indexer_n_heads": 8}
    model_dir = build_tiny_model(tmp_path, "qwen4_exp_text", **overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return str(model_dir), reference


def test_a_query_attends_its_best_blocks_and_the_tokens_after_its_last_whole_block():
    torch.manual_seed(2)
    q, pooled = torch.randn(2, 3, 8), torch.randn(4, 8)
    selected = block_selection(q, pooled, torch.tensor([6, 17]), ratio=4, block_topk=2, seq_len=18)
    assert selected[0].nonzero()[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]  # one whole block, then its tail
    scores = torch.relu(q[1] @ pooled.T).sum(0)
    best = sorted(scores.topk(2).indices.tolist())
    expected = [token for block in best for token in range(4 * block, 4 * block + 4)] + [16, 17]
    assert selected[1].nonzero()[:, 0].tolist() == expected


def test_per_layer_embeddings_stay_refused_with_the_reason():
    config = tiny_config("qwen4_exp_text", 512, **tiny_overrides("qwen4_exp_text"), ple_layer_ids=[1])
    support = model_support(config)
    assert not support.ok and support.reason is not None and "hashed n-grams" in support.reason


def test_qwen4_exp_equals_transformers_through_chunks_preemption_and_prefix_hits(tmp_path, monkeypatch):
    model_dir, reference = _tiny_qwen4_exp(tmp_path)
    prompts = random_prompts(5, (2, 45), 512, seed=43, shared_prefix=21)
    ties = BlockTies(monkeypatch)
    expected = [hf_greedy(reference, prompt, 8) for prompt in prompts]
    monkeypatch.undo()
    assert ties.gaps and min(ties.gaps) > 1e-4, "block scores tie at the top-k boundary, or none was ranked"
    assert len({tuple(tokens) for tokens in expected}) > 1  # the tokens depend on the prompt
    spec = KVCacheSpec.from_hf_config(reference.config, torch.float32)
    attention = [layer for layer in spec.layers if layer.num_kv_heads]
    assert [(layer.head_dim, layer.value_head_dim) for layer in attention] == [(16, 16 + 16 // 2)]
    # 7-token chunks split the blocks; a small cache (six blocks beside the requests'
    # recurrent state) makes requests preempt.
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=7, max_num_seqs=3, max_model_len=80,
              kv_cache_memory_bytes=6 * spec.bytes_per_block(16) + 24 * 1024)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    # The rerun: index keys come back with the cached blocks.
    assert_exact_through_preemption_and_hits(llm, prompts, expected, rerun=3)
    llm.close()
