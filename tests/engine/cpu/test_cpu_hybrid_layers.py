"""The CPU rewrites of hybrid models (engine/cpu/hybrid_layers.py, hybrid_decoder.py):
fused zero-centred and gated norms and packed gated delta-net projections give the
modules' outputs, and float32 hybrids running them (fused decoder layers, the last
layer's sampled rows in prefill steps) pass the load check and give transformers'
greedy tokens, with each path on and turned off."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from torch import nn

from shardline import LLM, SamplingParams
from shardline.engine.cpu.hybrid_decoder import FusedHybridDecoderLayer
from shardline.engine.cpu.hybrid_layers import (
    FusedGatedRMSNorm,
    FusedOffsetRMSNorm,
    GatedDeltaNetProjections,
    pack_gated_delta_net_projections,
)
from shardline.engine.cpu.linear import onednn_linear_available, pack_linears
from shardline.engine.kernels.cpu_fused import fused_kernels_available, rms_norm, rms_norm_reference
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.recurrent.gated_delta_net import input_projections
from shardline.engine.recurrent.state import install_recurrent_layers

from ..hf_reference import hf_greedy, random_prompts

needs_kernels = pytest.mark.skipif(not fused_kernels_available(torch.float32),
                                   reason="the fused CPU kernels could not be built here")
needs_onednn = pytest.mark.skipif(not onednn_linear_available(torch.float32),
                                  reason="oneDNN's packed linear does not run here")

_GDN = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4)
# Gated delta-net, full attention, gated delta-net, full attention (the last layer
# attends, as in qwen3_5_text's pattern).
CONFIG = dict(_GDN, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)
# Qwen3-Next: fused qkvz and ba projections, MoE MLPs; its last layer a gated delta-net.
NEXT_CONFIG = dict(_GDN, num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "linear_attention"],
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


@needs_kernels
def test_fused_norms_reproduce_the_hybrid_norms():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    generator = torch.Generator().manual_seed(0)
    norm, gated = Qwen3_5RMSNorm(24, eps=1e-6), Qwen3_5RMSNormGated(24, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=generator) * 0.5)
        gated.weight.copy_(torch.randn(24, generator=generator) * 0.5 + 1)
        x, gate = (torch.randn(7, 24, generator=generator) * 3 for _ in range(2))
        torch.testing.assert_close(FusedOffsetRMSNorm(norm)(x), norm(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(FusedGatedRMSNorm(gated)(x, gate), gated(x, gate), rtol=1e-5, atol=1e-5)
        # The gate as a strided view of a wider projection's output, in another shape.
        wide = torch.randn(7, 40, generator=generator)
        torch.testing.assert_close(FusedGatedRMSNorm(gated)(x, wide[:, 8:32].view(7, 1, 24)),
                                   gated(x, wide[:, 8:32].contiguous()), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.skipif(not fused_kernels_available(torch.bfloat16), reason="the fused kernels take no bfloat16 here")
@pytest.mark.parametrize("norm_class", ["qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextRMSNormGated",
                                        "qwen3_5.modeling_qwen3_5.Qwen3_5RMSNormGated",
                                        "qwen3_next.modeling_qwen3_next.Qwen3NextRMSNormGated"])
def test_fused_gated_norm_rounds_as_the_models_own_in_bfloat16(norm_class):
    """In bfloat16 the gated norm rounds weight * normed to bfloat16, then multiplies by
    silu(gate) in float32 and rounds once: the fused norm gives the module's bits
    wherever its kernel's normalisation gives torch's (nearly everywhere)."""
    module_name, class_name = norm_class.rsplit(".", 1)
    module = importlib.import_module(f"transformers.models.{module_name}")
    generator = torch.Generator().manual_seed(0)
    gated = getattr(module, class_name)(128, eps=1e-6)
    with torch.no_grad():
        gated.weight.copy_(torch.randn(128, generator=generator) * 0.5 + 1)
    gated = gated.to(torch.bfloat16)
    x, gate = ((torch.randn(64, 128, generator=generator) * 3).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        expected, actual = gated(x, gate), FusedGatedRMSNorm(gated)(x, gate)
        weight = gated.weight.detach()
        same_norm = rms_norm(x, weight, 1e-6) == rms_norm_reference(x, weight, 1e-6)
    assert same_norm.float().mean() > 0.99
    assert torch.equal(actual[same_norm], expected[same_norm])


@needs_onednn
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_packed_projections_give_the_layers_own(model_type):
    """One packed matmul gives (q|k|v, z, b, a) as the layer's own projections (and
    Qwen3-Next's reordering of them) do."""
    config = transformers.AutoConfig.for_model(model_type, hidden_size=64, **NEXT_CONFIG)
    torch.manual_seed(0)
    layer = transformers.AutoModelForCausalLM.from_config(config).model.layers[1].linear_attn.eval()
    model = nn.ModuleList([layer])
    install_recurrent_layers_in(model, config)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = input_projections(layer, x)
        pack_linears(model, rows_hint=16, dtypes=(torch.float32,))
        assert pack_gated_delta_net_projections(model, rows_hint=16) == 1
        first = layer.in_proj_qkvz if model_type == "qwen3_next" else layer.in_proj_qkv
        assert isinstance(first, GatedDeltaNetProjections)
        actual = input_projections(layer, x)
        for got, want in zip(actual, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def install_recurrent_layers_in(container: nn.ModuleList, config) -> None:
    """Wrap the container's gated delta-net module in a RecurrentLayer, as the engine does."""
    holder = nn.Module()
    holder.config, holder.layers = config, container
    install_recurrent_layers(holder)


# Each path off is also covered on a dense model by test_cpu_paths' fallback test, so the
# hybrid's off variants run with the slow set.
SETTINGS = ["", pytest.param("fused_kernels=off", marks=pytest.mark.slow),
            pytest.param("packed_linears=off", marks=pytest.mark.slow)]


@needs_kernels
@pytest.mark.parametrize("setting", SETTINGS)
def test_float32_hybrid_with_its_cpu_rewrites_matches_transformers(tmp_path, monkeypatch, setting):
    model_dir = str(build_tiny_model(tmp_path, "qwen3_5_text", **CONFIG))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(4, (3, 40), 500, seed=5)
    expected = [hf_greedy(hf_model, prompt, 6) for prompt in prompts]
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", setting)
    # A 32-token budget: prefill steps sample fewer rows than they run.
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=32, max_model_len=64)
    layers = llm.llm_engine.model.model.layers
    paths = llm.llm_engine.cpu_paths
    assert all(isinstance(layer, FusedHybridDecoderLayer) == paths.fused_kernels for layer in layers)
    assert isinstance(layers[0].input_layernorm, FusedOffsetRMSNorm) == paths.fused_kernels
    assert isinstance(layers[0].linear_attn.layer.norm, FusedGatedRMSNorm) == paths.fused_kernels
    assert isinstance(layers[0].linear_attn.layer.in_proj_qkv, GatedDeltaNetProjections) == paths.packed_linears
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=6),
                           use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    llm.close()


@needs_kernels
def test_float32_qwen3_next_with_its_cpu_rewrites_matches_transformers(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "qwen3_next", **NEXT_CONFIG))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(4, (3, 40), 500, seed=6)
    expected = [hf_greedy(hf_model, prompt, 6) for prompt in prompts]
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=32, max_model_len=64)
    layers = llm.llm_engine.model.model.layers
    if llm.llm_engine.cpu_paths.packed_linears:
        assert all(isinstance(layer, FusedHybridDecoderLayer) for layer in layers)
        assert layers[0].weights is not None  # one packed matmul for queries, gates, keys and values
        assert isinstance(layers[1].linear_attn.layer.in_proj_qkvz, GatedDeltaNetProjections)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=6),
                           use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    llm.close()
