"""Embedding models over tensor-parallel ranks: a decoder embedding model (a tiny Llama
run as the pooling engine's base model) on 2 gloo ranks gives 1 rank's embeddings and
per-token states within float32 tolerance, its layers split on rank 0; an encoder whose
attention projections no rule splits (BERT's query/key/value) is refused before any
rank starts."""

from __future__ import annotations

import pytest
import torch

from shardline import LLM
from shardline.engine.model.tiny import build_tiny_model, tiny_config
from shardline.engine.parallel.group import ShardingError
from shardline.engine.parallel.layers import RowParallelLinear, VocabParallelEmbedding
from shardline.engine.parallel.verdict import tensor_parallel_verdict

PROMPTS = [[5, 9, 33, 70, 100, 7, 8, 200], [6, 10, 34, 71], [300, 12, 45, 99, 3, 17], [44] * 20]
OPTIONS = dict(task="embed", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)


def vectors(llm: LLM) -> torch.Tensor:
    outputs = llm.embed([{"prompt_token_ids": prompt} for prompt in PROMPTS], use_tqdm=False)
    return torch.tensor([output.outputs.embedding for output in outputs])


def token_states(llm: LLM) -> list[torch.Tensor]:
    outputs = llm.encode([{"prompt_token_ids": prompt} for prompt in PROMPTS], pooling_task="encode",
                         use_tqdm=False)
    return [torch.as_tensor(output.outputs.data) for output in outputs]


def test_embeddings_on_two_ranks_equal_one_rank(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "llama", num_attention_heads=4, num_key_value_heads=2))
    one_rank = LLM(model_dir, **OPTIONS)
    try:
        expected, expected_states = vectors(one_rank), token_states(one_rank)
    finally:
        one_rank.close()
    assert torch.cdist(expected, expected).triu(1)[0, 1:].min() > 1e-3  # the prompts' embeddings differ
    two_ranks = LLM(model_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        torch.testing.assert_close(vectors(two_ranks), expected, rtol=1e-5, atol=1e-5)
        for states, wanted in zip(token_states(two_ranks), expected_states, strict=True):
            torch.testing.assert_close(states, wanted, rtol=1e-5, atol=1e-5)
        kinds = {type(module) for module in two_ranks.llm_engine.model.modules()}  # pyright: ignore[reportAttributeAccessIssue]
        assert {RowParallelLinear, VocabParallelEmbedding} <= kinds
    finally:
        two_ranks.close()


def test_an_encoder_no_rule_splits_is_refused_before_ranks_start():
    config = tiny_config("bert", 512)
    with pytest.raises(ShardingError, match="of its 2 attention layers have projections the tensor-parallel rules"):
        tensor_parallel_verdict(config, 2, quantization=None, task="embed")
