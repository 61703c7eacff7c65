"""Which shares the ranks hold and what they refuse, without starting ranks: the refusals
made before any rank starts, the key-value heads each rank reads, the cache spec per
rank, and the plan's patterns."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from torch import nn

from shardline import LLM
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.tiny import build_tiny_model, tiny_config
from shardline.engine.parallel.group import RankGroup
from shardline.engine.parallel.sharding import (
    COLUMN,
    EXPERTS,
    ROW,
    WHOLE,
    Heads,
    ShardingError,
    column_rows,
    plan_rules,
    shard_cache_spec,
    shard_model,
    split_of,
)
from shardline.engine.parallel.verdict import check_tensor_parallel, tensor_parallel_verdict

from ..coverage_configs import tiny_overrides


def refusal(config: transformers.PretrainedConfig, size: int = 2, **options) -> str:
    kwargs: dict[str, Any] = dict(quantization=None, task="generate") | options
    with pytest.raises(ShardingError) as error:
        check_tensor_parallel(config, size, **kwargs)
    return str(error.value)


def test_refusals_name_the_option_and_why():
    llama = tiny_config("llama", 512)
    check_tensor_parallel(llama, 2, quantization=None, task="generate")
    assert "4 attention heads, which do not split over 3 ranks" in refusal(llama, 3)
    check_tensor_parallel(llama, 2, quantization="fp8", task="generate")  # split with scales
    three_kv = tiny_config("llama", 512, num_attention_heads=12, num_key_value_heads=3)
    assert "3 key-value heads" in refusal(three_kv, 2)
    check_tensor_parallel(three_kv, 3, quantization=None, task="generate")


def test_an_engine_refuses_before_starting_ranks(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "llama", num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ShardingError, match="tensor_parallel_size=3: llama has 4 attention heads"):
        LLM(model_dir, tensor_parallel_size=3, dtype="float32")


def test_each_rank_reads_the_key_value_head_of_its_queries():
    # 8 query heads over 4 ranks, 2 key-value heads: ranks 0-1 read head 0, ranks 2-3 head 1.
    heads = Heads(8, 2)
    assert [heads.kv_head_of(rank, 4) for rank in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [heads.kv_head_of(rank, 2) for rank in range(2)] == [(0, 1), (1, 1)]
    k_proj = nn.Linear(64, 2 * 16)
    groups = [RankGroup(rank, 4, lambda: "") for rank in range(4)]
    rows = [column_rows(k_proj, "layers.0.self_attn.k_proj", group, heads, 1) for group in groups]
    assert rows == [slice(0, 16), slice(0, 16), slice(16, 32), slice(16, 32)]
    # a packed gate/up projection keeps this rank's share of each half
    gate_up = nn.Linear(64, 2 * 8)
    packed = column_rows(gate_up, "layers.0.mlp.gate_up_proj", RankGroup(1, 2, lambda: ""), None, 2)
    assert isinstance(packed, torch.Tensor) and packed.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


def test_the_cache_spec_per_rank_holds_its_heads():
    config = tiny_config("llama", 512, num_attention_heads=8, num_key_value_heads=2)
    spec = KVCacheSpec.from_hf_config(config, torch.float32)
    assert {layer.num_kv_heads for layer in shard_cache_spec(spec, config, 2).layers} == {1}
    assert {layer.num_kv_heads for layer in shard_cache_spec(spec, config, 4).layers} == {1}
    assert shard_cache_spec(spec, config, 4).bytes_per_block(16) * 2 == spec.bytes_per_block(16)


def test_plan_patterns_and_shape_rules():
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(
        "qwen2_moe", 512, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32))
    rules = plan_rules(model)
    assert split_of("model.layers.1.self_attn.o_proj", rules) == ROW
    assert split_of("model.layers.1.mlp.experts", rules) == EXPERTS
    # the shared expert is not in the plan: the shape rules split it as an MLP
    assert split_of("model.layers.1.mlp.shared_expert.gate_proj", rules) == COLUMN
    assert split_of("model.layers.1.mlp.shared_expert_gate", rules) is None
    qwen3_5 = transformers.AutoModelForCausalLM.from_config(tiny_config(
        "qwen3_5_text", 512, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"]))
    assert split_of("model.layers.0.linear_attn.in_proj_qkv", plan_rules(qwen3_5)) == WHOLE


def test_a_plan_style_not_run_is_refused():
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", 512))
    model.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "sequence_parallel"}
    with pytest.raises(ShardingError, match="'sequence_parallel'"):
        plan_rules(model)


@pytest.mark.parametrize(("arch", "overrides", "reason"), [
    # its compressed convolutional attention (a mixer run whole) feeds o_proj, which the rules split
    ("zaya", tiny_overrides("zaya"), "model.layers.0.self_attn: o_proj split row-wise, but the projection feeding it"),
])
def test_a_projection_left_whole_beside_split_ones_is_refused(arch, overrides, reason):
    """The verdict on the meta model refuses it (no rank starts): the whole projection's
    shapes would not meet the split ones'."""
    config = tiny_config(arch, 512, **overrides)
    with pytest.raises(ShardingError, match="not split over ranks") as error:
        tensor_parallel_verdict(config, 2, quantization=None, task="generate")
    assert str(error.value).startswith(reason)


def test_layers_with_their_own_head_counts_split_each_its_own():
    """dots3_note's sliding layers have heads of their own counts (its per-layer config:
    4 heads in its indexed layer, 2 in its sliding one): each layer's heads split over
    the ranks by its own count; a count that does not split is refused naming it."""
    config = tiny_config("dots3_note_text", 512, **tiny_overrides("dots3_note_text"))
    tensor_parallel_verdict(config, 2, quantization=None, task="generate")
    model = transformers.AutoModelForCausalLM.from_config(config)
    shard_model(model, RankGroup(1, 2, lambda: "no collective runs here"), num_attention_layers=2)
    for index, heads in ((0, 4), (1, 2)):
        attention: Any = model.get_submodule(f"model.layers.{index}.self_attn")
        assert attention.num_heads == heads // 2 and attention.g_proj.out_features == heads // 2
        assert attention.q_b_proj.out_features * 2 == model.config.per_layer_config[index].num_attention_heads * \
            attention.qk_head_dim
    with pytest.raises(ShardingError, match="dots3_note_text has 2 attention heads, which do not split over 4 ranks"):
        tensor_parallel_verdict(config, 4, quantization=None, task="generate")


@pytest.mark.parametrize("model_type", ["olmo2", "olmoe", "olmo_hybrid", "glm", "qwen4_exp_text", "deepseek_v4",
                                        "dots3_note_text", "phi3", "gpt_neox", "gpt2", "falcon", "gpt_bigcode",
                                        "zamba2", "bloom", "mpt", "codegen"])
def test_the_verdict_accepts_what_ranks_split(model_type):
    """The pre-flight verdict (the sharding step on the meta model) lets 2 ranks run
    them: each has a 2-rank test of its tokens (test_tp_split_input.py,
    test_tp_sparse_models.py, test_tp_fused.py)."""
    tensor_parallel_verdict(tiny_config(model_type, 512, **tiny_overrides(model_type)), 2, quantization=None,
                            task="generate")


@pytest.mark.parametrize(("model_type", "reason"), [
    # transformers before 5.25 plans its shared experts 'all_reduce'; from 5.25 the plan names
    # none, and its attention layers (a short convolution over the key channels) are not split
    ("inkling_text", "inkling_text's tensor-parallel plan splits 'layers.*.mlp.shared_experts' as 'all_reduce'"
     if "all_reduce" in transformers.AutoConfig.for_model("inkling_text").base_model_tp_plan.values()
     else "InklingForCausalLM: 2 of its 4 attention layers have projections the tensor-parallel rules split"),
    ("zaya", "model.layers.0.self_attn: o_proj split row-wise, but the projection feeding it"),
])
def test_the_verdict_refuses_what_ranks_do_not_split(model_type, reason):
    with pytest.raises(ShardingError) as error:
        tensor_parallel_verdict(tiny_config(model_type, 512, **tiny_overrides(model_type)), 2, quantization=None,
                                task="generate")
    assert str(error.value).startswith(reason)
