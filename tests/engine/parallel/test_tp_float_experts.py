"""gpt-oss's float experts (biased, gate_up transposed with its gate and up outputs
interleaved) split over tensor-parallel ranks by their intermediate size: 2 gloo ranks
give 1 rank's and transformers' greedy tokens through chunked prefill and prefix hits,
each rank holding its share of every expert weight (in units of 8, uneven where they do not divide), and
the float experts' split sums to the whole module's output."""

from __future__ import annotations

import copy
from typing import Any

import torch
import transformers

from shardline.engine.model.tiny import build_tiny_model, tiny_config
from shardline.engine.parallel.experts import split_float_experts
from shardline.engine.parallel.group import RankGroup
from shardline.engine.parallel.layers import ReducedOutput

from .test_tensor_parallel import check_against_one_rank
from .test_tp_out_proj import runner_model


def shape(module: torch.nn.Module, name: str) -> tuple[int, ...]:
    tensor = getattr(module, name)
    assert isinstance(tensor, torch.Tensor), name
    return tuple(tensor.shape)

# 9 units of 8: the ranks' shares of the intermediate size are 40 and 32.
GPT_OSS: dict[str, Any] = dict(head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                               intermediate_size=72)


def test_float_expert_shares_sum_to_the_whole_experts():
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("gpt_oss", 512, **GPT_OSS))
    experts = model.get_submodule("model.layers.0.mlp.experts")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    x = torch.randn(7, 64, generator=generator)
    top_k_index = torch.randint(0, 4, (7, 2), generator=generator)
    top_k_weights = torch.rand(7, 2, generator=generator)
    whole = experts(x, top_k_index, top_k_weights)
    total = torch.zeros_like(whole)
    for rank, share in enumerate((40, 32)):
        part = split_float_experts(copy.deepcopy(experts), "experts", RankGroup(rank, 2, lambda: ""))
        assert isinstance(part, ReducedOutput)
        inner = part.inner
        assert shape(inner, "gate_up_proj") == (4, 64, 2 * share) and shape(inner, "down_proj") == (4, share, 64)
        assert shape(inner, "gate_up_proj_bias") == (4, 2 * share)
        down_bias = inner.down_proj_bias
        assert isinstance(down_bias, torch.Tensor) and bool(down_bias.any()) == (rank == 0)  # added once: rank 0
        total += inner(x, top_k_index, top_k_weights)
    assert whole.abs().max() > 0.1
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_gpt_oss_float_experts_on_two_ranks(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "gpt_oss", **GPT_OSS))
    llm = check_against_one_rank(model_dir, reference_dtype=torch.float32)
    try:
        experts = runner_model(llm).get_submodule("model.layers.0.mlp.experts")
        assert isinstance(experts, ReducedOutput)  # rank 0's share: 40 of the 72
        assert shape(experts.inner, "gate_up_proj") == (4, 64, 80) and shape(experts.inner, "down_proj") == (4, 40, 64)
    finally:
        llm.close()
