"""Models whose tensor-parallel plan gathers an attention's or an MLP's input whole
before a ``rowwise_split_input`` projection (OLMo's q/k norms over all heads, a fused
gate_up_proj's chunk, Qwen4-exp's hyper-connections) on 2 gloo ranks: the heads split
with their norms spanning the ranks, the tokens 1 rank's and transformers' (float32)
through chunked prefill and prefix hits, each rank holding half the heads; without
ranks: the splits the plan's styles resolve to and the spanning norms' shares."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.tiny import build_tiny_model, tiny_config
from shardline.engine.parallel.attention_norms import weight_in_float32
from shardline.engine.parallel.group import RankGroup, ShardingError
from shardline.engine.parallel.layers import RowParallelLinear, SpanningRMSNorm
from shardline.engine.parallel.sharding import (
    COLUMN,
    PACKED_COLUMN,
    ROW,
    WHOLE,
    plan_rules,
    shard_cache_spec,
    shard_model,
    split_of,
)

from ..coverage_configs import tiny_overrides
from .test_tp_recurrent import check_two_ranks

CASES: dict[str, dict[str, Any]] = {
    # q_norm and k_norm over all heads; gated delta-net layers with separate q/k/v/g/a/b projections
    "olmo_hybrid": dict(linear_key_head_dim=16, linear_value_head_dim=16, num_hidden_layers=3,
                        layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "olmo2": {},
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "glm": {},  # a fused gate_up_proj chunked into gate and up
    "qwen4_exp_text": dict(tiny_overrides("qwen4_exp_text"), num_hidden_layers=2),
}
NO_COLLECTIVE = "no collective runs while splitting"


def test_olmo_hybrid_on_two_ranks(tmp_path):
    """Each rank keeps 2 of the gated delta-net's 4 heads (state and convolution
    channels) and 2 of the 4 attention heads, whose q/k norms span the ranks."""
    model_dir = str(build_tiny_model(tmp_path, "olmo_hybrid", **CASES["olmo_hybrid"]))
    whole, split = check_two_ranks(model_dir, torch.float32, preempt=False)
    assert set(split) == set(whole) == {0, 2}
    for index in whole:
        assert whole[index] == {"conv": (3, 192), "recurrent": (4, 16, 16)}
        assert split[index] == {"conv": (3, 96), "recurrent": (2, 16, 16)}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["olmo2", "olmoe", "glm", "qwen4_exp_text"])
def test_split_input_plans_on_two_ranks(tmp_path, arch):
    model_dir = str(build_tiny_model(tmp_path, arch, **CASES[arch]))
    check_two_ranks(model_dir, torch.float32, preempt=False)


def test_split_input_styles_resolve_to_splits():
    """OLMo's q/k/v (planned gathered) split by heads and o_proj by rows; glm's
    gate_up_proj packed with down_proj by rows; Qwen4-exp's hyper-connection weight whole."""
    olmo2 = transformers.AutoModelForCausalLM.from_config(tiny_config("olmo2", 512))
    rules = plan_rules(olmo2)
    assert [split_of(f"model.layers.0.self_attn.{leaf}", rules) for leaf in ("q_proj", "k_proj", "o_proj")] == \
        [COLUMN, COLUMN, ROW]
    glm = transformers.AutoModelForCausalLM.from_config(tiny_config("glm", 512))
    rules = plan_rules(glm)
    assert [split_of(f"model.layers.0.mlp.{leaf}", rules) for leaf in ("gate_up_proj", "down_proj")] == \
        [PACKED_COLUMN, ROW]
    qwen4 = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen4_exp_text", 512,
                                                                      **CASES["qwen4_exp_text"]))
    assert split_of("model.layers.0.attn_hyper_connection.input_mix_weight_down", plan_rules(qwen4)) == WHOLE


def test_norms_over_all_heads_span_the_ranks():
    """olmo2 (4 query heads, 2 key-value heads of 16): each rank's q_norm and k_norm hold
    its heads' weights, over the whole width, in OLMo's form (weight applied in float32)."""
    whole = transformers.AutoModelForCausalLM.from_config(tiny_config("olmo2", 512)).eval()
    for norm in ("q_norm", "k_norm"):
        nn.init.normal_(whole.get_submodule(f"model.layers.0.self_attn.{norm}").weight)
    for rank in (0, 1):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("olmo2", 512)).eval()
        model.load_state_dict(whole.state_dict())
        shard_model(model, RankGroup(rank, 2, lambda: NO_COLLECTIVE), 2)
        attention = model.get_submodule("model.layers.0.self_attn")
        assert isinstance(attention.o_proj, RowParallelLinear) and attention.q_proj.out_features == 32
        for norm, width in (("q_norm", 64), ("k_norm", 32)):
            spanning = getattr(attention, norm)
            share = width // 2
            assert isinstance(spanning, SpanningRMSNorm) and spanning.width == width and spanning.weight_in_float32
            expected = whole.get_submodule(f"model.layers.0.self_attn.{norm}").weight[rank * share: (rank + 1) * share]
            assert torch.equal(spanning.weight, expected)


def test_the_norm_form_is_probed_and_other_forms_refused():
    """Llama's RMS norm applies its weight after the cast back (OLMo's before); Gemma's
    (1 + weight) form is no RMS norm the ranks span: refused naming it."""
    llama = LlamaRMSNorm(64)
    nn.init.normal_(llama.weight)
    assert weight_in_float32(llama, "llama.q_norm", 1e-6) is False
    gemma = GemmaRMSNorm(64)
    nn.init.normal_(gemma.weight)
    with pytest.raises(ShardingError, match="gemma.q_norm: GemmaRMSNorm over all heads is not an RMS norm"):
        weight_in_float32(gemma, "gemma.q_norm", 1e-6)


def test_each_rank_caches_the_whole_index_key():
    """Qwen4-exp's indexed layer keeps its one index key after the values, spread over
    its key-value heads' columns: on a rank with half the heads, over those heads."""
    config = tiny_config("qwen4_exp_text", 512, **CASES["qwen4_exp_text"])
    spec = KVCacheSpec.from_hf_config(config, torch.float32)
    sharded = shard_cache_spec(spec, config, 2)
    text_config = config.get_text_config()
    indexed = [index for index, kind in enumerate(text_config.layer_types) if kind == "indexed_attention"]
    assert indexed
    for index in indexed:
        whole, share = spec.layers[index], sharded.layers[index]
        assert share.num_kv_heads * 2 == whole.num_kv_heads
        values = whole.value_head_dim - -(-text_config.indexer_head_dim // whole.num_kv_heads)
        assert (share.value_head_dim - values) * share.num_kv_heads >= text_config.indexer_head_dim


@pytest.fixture
def one_rank_group():
    """A gloo group of one rank in this process (its collectives real, the sum over one
    rank the tensor itself), closed after the test."""
    store = torch.distributed.HashStore()  # pyright: ignore[reportPrivateImportUsage] - public, not in __all__
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield RankGroup(0, 1, lambda: "one rank")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("norm_class", [Olmo2RMSNorm, LlamaRMSNorm])
def test_a_spanning_norm_in_its_probed_form_is_the_norm(one_rank_group, norm_class):
    """In bfloat16, where the two forms differ (weight applied before or after the cast
    back), the spanning norm over the whole width gives the norm's own output."""
    norm = norm_class(64, eps=1e-6).to(torch.bfloat16)
    nn.init.normal_(norm.weight)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    spanning = SpanningRMSNorm(norm.weight, 64, 1e-6, one_rank_group,
                               weight_in_float32=weight_in_float32(norm, "q_norm", 1e-6))
    with torch.no_grad():
        assert torch.equal(spanning(x), norm(x))
