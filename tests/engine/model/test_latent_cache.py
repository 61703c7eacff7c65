"""Latent attention layers cache latents (engine/model/adapters/latent.py): the cache is
kv_lora_rank + qk_rope_head_dim numbers per token and layer, and greedy tokens equal
transformers' through chunked prompts, absorbed decode steps and prefix-cache hits, for
every latent type (with and without a query LoRA). The Triton backend's path (the CUDA
one) is tested in tests/engine/kernels/test_latent_triton_path.py."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.adapters.latent import LATENT_LAYOUTS, caches_latents, latent_cache_refusal
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.tiny import build_tiny_model

from ..coverage import tiny_overrides
from ..hf_reference import hf_greedy

MLA: dict = dict(num_key_value_heads=4, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, kv_lora_rank=24,
           q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           first_k_dense_replace=1, n_group=1, topk_group=1)
PREFIX = list(range(3, 30))
PROMPTS = [PREFIX + [40, 41, 42], PREFIX + [43, 44, 45, 46, 47], [90, 17, 88, 12, 60, 3, 30, 31],
           [5, 17, 88, 12, 60, 3, 30, 31]]

def test_latent_layers_cache_the_latent_and_rotary_key_alone():
    config = transformers.AutoConfig.for_model("deepseek_v3", num_hidden_layers=2, num_attention_heads=8,
                                               kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                               v_head_dim=24)
    assert caches_latents(config)
    spec = KVCacheSpec.from_hf_config(config, torch.float32)
    assert {(layer.num_kv_heads, layer.head_dim, layer.value_head_dim) for layer in spec.layers} == {(1, 80, 0)}
    assert spec.bytes_per_block(16) == 4 * 16 * 80 * 2
    fp8 = transformers.AutoConfig.for_model("deepseek_v3", num_hidden_layers=2, num_attention_heads=8,
                                            quantization_config={"quant_method": "fp8"})
    assert caches_latents(fp8)  # an FP8 kv_b_proj is dequantized for the absorbed projections


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_with_latents_cached(tmp_path):
    model_dir = build_tiny_model(tmp_path, "deepseek_v3", **MLA)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    expected = [hf_greedy(reference, prompt, 8) for prompt in PROMPTS]
    assert expected[2] != expected[3]  # the tokens depend on the prompt
    # Chunks of 8 tokens: prompts attend up-projected over earlier chunks' latents.
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=8, max_num_seqs=2)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    caches = engine.runner.kv_caches
    assert {tuple(key.shape[2:]) + tuple(value.shape[2:]) for key, value in caches} == {(1, 24 + 16, 1, 0)}
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)  # a prefix-cache hit
    llm.close()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    assert list(again[0].outputs[0].token_ids) == expected[1]


# Every latent type at the coverage sweep's tiny sizes: query LoRA where that config has
# one (q_lora_rank 24), none for deepseek_v2 (as DeepSeek-V2-Lite), bailing_hybrid and
# kimi_linear (whose latent layers sit beside linear-attention ones). The sparse-attention
# types (an indexer's keys beside the latents) are tested in tests/engine/test_sparse_indexer.py.
TYPE_CASES = {model_type: {} for model_type, layout in LATENT_LAYOUTS.items() if layout.indexer is None}
TYPE_CASES["deepseek_v2"] = dict(q_lora_rank=None)
TYPE_CASES["minicpm3-no-q-lora"] = dict(q_lora_rank=None)
FAST_TYPES = {"deepseek_v2", "longcat_flash"}


@pytest.mark.parametrize("case", [case if case in FAST_TYPES else pytest.param(case, marks=pytest.mark.slow)
                                  for case in TYPE_CASES])
def test_every_latent_type_caches_latents_and_equals_transformers(case, tmp_path):
    model_type = case.split("-")[0]
    model_dir = build_tiny_model(tmp_path, model_type, **{**tiny_overrides(model_type), **TYPE_CASES[case]})
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    expected = [hf_greedy(reference, prompt, 6) for prompt in PROMPTS]
    assert expected[2] != expected[3]  # the tokens depend on the prompt
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=8, max_num_seqs=2)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    rank, rope = reference.config.kv_lora_rank, reference.config.qk_rope_head_dim
    attention = [(tuple(key.shape[2:]), tuple(value.shape[2:])) for key, value in engine.runner.kv_caches
                 if key.numel()]
    assert attention and set(attention) == {((1, rank + rope), (1, 0))}
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
    llm.close()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected


def test_a_latent_type_keeps_full_keys_and_values_with_its_reason():
    config = transformers.AutoConfig.for_model("deepseek_v2", num_hidden_layers=2,
                                               quantization_config={"quant_method": "gptq", "bits": 4})
    reason = latent_cache_refusal(config)
    assert reason is not None and "'gptq'" in reason and not caches_latents(config)
    assert latent_cache_refusal(transformers.AutoConfig.for_model("llama")) is None


@pytest.mark.parametrize("decode_kernel", ["on", "off"])
def test_decode_steps_through_the_c_kernel_or_torch_equal_transformers(decode_kernel, tmp_path, monkeypatch):
    """The CPU decode kernel path takes the latent layers' decode steps
    (kernels/cpu_mla.py) where it builds; turned off, torch's absorbed einsums do."""
    from shardline.engine.kernels.cpu_mla import load_library

    if decode_kernel == "on" and load_library() is None:
        pytest.skip("no C compiler: the engine uses its torch path")
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", f"decode_kernel={decode_kernel}")
    model_dir = build_tiny_model(tmp_path, "deepseek_v2", **{**tiny_overrides("deepseek_v2"), "q_lora_rank": None})
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    expected = [hf_greedy(reference, prompt, 8) for prompt in PROMPTS]
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=4)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    taken = {module.latent_decode_kernel for module in engine.runner.model.modules()
             if hasattr(module, "latent_decode_kernel")}
    assert taken == {decode_kernel == "on"}
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS],
                           SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    llm.close()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected


def test_fp8_block_deepseek_v3_caches_latents_and_equals_the_dequantized_model(tmp_path):
    """DeepSeek-V3's FP8 checkpoints (every linear in 8x8-element blocks with
    weight_scale_inv here): kv_b_proj stays quantized, its float weight dequantized
    once for the absorbed projections; tokens equal the float model holding the
    dequantized weights."""
    from shardline.engine.quantization.linear import QuantizedLinear

    from ..quantization import checkpoints as ckpt
    from ..quantization.moe_checkpoints import fused_reference_model, tiny_moe

    float_dir = tiny_moe(tmp_path / "float", "deepseek_v3")
    out_dir = tmp_path / "fp8"
    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [8, 8]}
    dequantized = ckpt.write_quantized(float_dir, out_dir, quantization, ckpt.fp8_blocks((8, 8)))
    assert "model.layers.0.self_attn.kv_b_proj" in dequantized
    reference = fused_reference_model(float_dir, dequantized)
    expected = [hf_greedy(reference, prompt, 8) for prompt in PROMPTS]
    assert expected[2] != expected[3]
    llm = LLM(str(out_dir), dtype="float32", max_num_batched_tokens=8, max_num_seqs=2)
    model = ckpt.engine_model(llm)
    assert isinstance(model.get_submodule("model.layers.0.self_attn.kv_b_proj"), QuantizedLinear)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    assert {tuple(key.shape[2:]) + tuple(value.shape[2:]) for key, value in engine.runner.kv_caches} == {(1, 24, 1, 0)}
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS],
                           SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    llm.close()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
