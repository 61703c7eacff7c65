"""Attention output projections named out_proj or Wo (OPT, GPT-Neo, XGLM, BioGPT,
ModernBERT-decoder, LFM2) are split row-wise beside their column-split q/k/v, so those
models run on 2 gloo ranks with 1 rank's (and transformers') greedy tokens; a module of
the same name elsewhere (an MLP's Wo, a recurrent mixer's out_proj) is not split by it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from torch import nn

from shardline import LLM
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.tiny import build_tiny_model, tiny_config
from shardline.engine.parallel.group import RankGroup
from shardline.engine.parallel.layers import RowParallelLinear
from shardline.engine.parallel.sharding import ROW, attention_rules, shard_model

from .test_tensor_parallel import assert_closed, check_against_one_rank, rank_processes

CASES: dict[str, dict[str, Any]] = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=6),
    "xglm": {},
    "biogpt": {},
    "modernbert-decoder": {},
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]),
}
# xglm's eager attention takes no float64 (its mask's minimum overflows float32)
FLOAT32 = {"xglm"}


def split_on_rank_zero(arch: str, **overrides: Any) -> nn.Module:
    """A tiny ``arch`` model as rank 0 of 2 splits it (no collective runs while splitting)."""
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, 512, **overrides))
    shard_model(model, RankGroup(0, 2, lambda: "no collective runs here"), num_attention_layers=0)
    return model


def runner_model(llm: LLM) -> nn.Module:
    """The model rank 0 runs."""
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    return engine.runner.model


def test_opt_on_two_ranks(tmp_path):
    """Each rank holds half the heads' q/k/v rows and out_proj's columns (its bias added
    once, after the sum); the MLP's fc1/fc2, which no rule names, stay whole."""
    model_dir = str(build_tiny_model(tmp_path, "opt"))
    llm = check_against_one_rank(model_dir)
    processes = rank_processes(llm)
    attention = runner_model(llm).get_submodule("model.decoder.layers.0.self_attn")
    out_proj = attention.get_submodule("out_proj")
    assert isinstance(out_proj, RowParallelLinear) and out_proj.bias is not None
    assert out_proj.weight.shape == (64, 32) and attention.get_parameter("q_proj.weight").shape == (32, 64)
    assert getattr(attention, "num_heads") == 2  # noqa: B009 - an attribute transformers' module sets
    assert_closed(llm, processes)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(set(CASES) - {"lfm2"}))  # lfm2: test_tp_recurrent.py, with its convolutions
def test_out_proj_models_on_two_ranks(tmp_path, arch):
    model_dir = str(build_tiny_model(tmp_path, arch, **CASES[arch]))
    llm = check_against_one_rank(model_dir, reference_dtype=torch.float32 if arch in FLOAT32 else torch.float64)
    processes = rank_processes(llm)
    kinds = {type(module) for module in runner_model(llm).modules()}
    assert RowParallelLinear in kinds
    assert_closed(llm, processes)


def test_only_attention_outputs_take_the_rule():
    """ModernBERT-decoder: the attention's Wo is row-split, the MLP's Wo (beside a fused
    Wi no rule splits) stays whole; LFM2: the attention's out_proj is row-split, the
    short convolution's out_proj is its mixer's own (split with its channels)."""
    modernbert = transformers.AutoModelForCausalLM.from_config(tiny_config("modernbert-decoder", 512))
    assert attention_rules(modernbert) == {f"model.layers.{i}.attn.Wo": ROW for i in range(2)}
    model = split_on_rank_zero("modernbert-decoder")
    attention_wo, mlp_wo = model.get_submodule("model.layers.0.attn.Wo"), model.get_submodule("model.layers.0.mlp.Wo")
    assert isinstance(attention_wo, RowParallelLinear) and type(mlp_wo) is nn.Linear
    assert mlp_wo.in_features == 128 and attention_wo.weight.shape == (64, 32)
    lfm2 = transformers.AutoModelForCausalLM.from_config(tiny_config("lfm2", 512, **CASES["lfm2"]))
    assert attention_rules(lfm2) == {"model.layers.1.self_attn.out_proj": ROW}
