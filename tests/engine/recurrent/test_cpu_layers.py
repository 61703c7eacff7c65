"""The CPU rewrites of hybrid models (engine/recurrent/cpu_layers.py): fused zero-centred
and gated norms give the modules' outputs, and a float32 hybrid running them (and
its last MLP at the sampled rows of prefill steps) passes the load check and gives
transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.kernels.cpu_fused import fused_kernels_available
from shardline.engine.recurrent.cpu_layers import FusedGatedRMSNorm, FusedOffsetRMSNorm, SampledRowsMLP
from shardline.engine.tiny import build_tiny_model

from ..hf_reference import hf_greedy, random_prompts

needs_kernels = pytest.mark.skipif(not fused_kernels_available(torch.float32),
                                   reason="the fused CPU kernels could not be built here")

# Gated delta-net, full attention, gated delta-net, full attention (the last layer
# attends, as in qwen3_5_text's pattern).
CONFIG = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=4,
              layer_types=["linear_attention", "full_attention"] * 2)


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


@needs_kernels
def test_float32_hybrid_with_its_cpu_rewrites_matches_transformers(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "qwen3_5_text", **CONFIG))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(4, (3, 40), 500, seed=5)
    expected = [hf_greedy(hf_model, prompt, 6) for prompt in prompts]
    # A 32-token budget: prefill steps sample fewer rows than they run.
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=32, max_model_len=64)
    layers = llm.llm_engine.model.model.layers
    assert isinstance(layers[-1].mlp, SampledRowsMLP)
    assert isinstance(layers[0].input_layernorm, FusedOffsetRMSNorm)
    assert isinstance(layers[0].linear_attn.layer.norm, FusedGatedRMSNorm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=6),
                           use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    llm.close()
