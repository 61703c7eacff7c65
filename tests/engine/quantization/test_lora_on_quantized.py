"""LoRA adapters on a quantized base, for each kind of base: W4 (GPTQ int4 groups), W8
(compressed-tensors int8 per channel, FP8 128x128-style blocks) and W8A8 (int8 weights,
inputs quantized per token). The base linears stay quantized and each request's adapter
delta is added on top of the base layer's output, token for token as transformers'
generate of the same base with peft's adapter: merged into the dequantized weights for
the weight-only kinds; unmerged on transformers' own load for W8A8, whose base layer
quantizes its input while the adapter reads it unquantized (as vLLM applies LoRA to
quantized layers)."""

from __future__ import annotations

from typing import Any

import peft
import pytest
import torch

from shardline import LLM, LoRARequest, SamplingParams
from shardline.engine.lora.layers import BatchedLoRALinear
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.quantization.linear import QuantizedLinear

from ..hf_reference import hf_greedy, random_prompts
from ..lora.test_lora import make_adapter
from . import checkpoints as ckpt
from .test_formats import clear_prompts

PROMPTS = random_prompts(6, (3, 20), 512, seed=11)
MAX_NEW_TOKENS = 8
_INT8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
_INT8_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}

# kind: (quantization_config, quantizer, dtype the base linears hold, inputs quantized)
KINDS: dict[str, tuple[dict[str, Any], Any, torch.dtype, bool]] = {
    "w4_gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
                ckpt.gptq(32, True), torch.uint8, False),
    "w8_int8_channel": (ckpt.compressed_config("int-quantized", _INT8_CHANNEL), ckpt.int8_per_channel,
                        torch.int8, False),
    "w8_fp8_blocks": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
                      ckpt.fp8_blocks((32, 32)), torch.float8_e4m3fn, False),
    "w8a8_int8": (ckpt.compressed_config("int-quantized", _INT8_CHANNEL, _INT8_TOKEN), ckpt.int8_per_channel,
                  torch.int8, True),
}


@pytest.mark.parametrize("kind", [
    "w4_gptq", "w8a8_int8",
    pytest.param("w8_int8_channel", marks=pytest.mark.slow), pytest.param("w8_fp8_blocks", marks=pytest.mark.slow)])
def test_lora_on_a_quantized_base(tmp_path, kind):
    config, quantize, stored_dtype, inputs_quantized = KINDS[kind]
    float_dir = build_tiny_model(tmp_path / "float", "llama")
    dequantized = ckpt.write_quantized(float_dir, tmp_path / kind, config, quantize)
    adapter = make_adapter(str(float_dir), tmp_path / "adapter", seed=5, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj", "down_proj"])
    adapted: Any  # a PeftModel (unmerged) or the merged transformers model: both generate
    if inputs_quantized:  # transformers' own load (compressed-tensors' forward) under peft's adapter
        base = ckpt.transformers_own_model(tmp_path / kind)
        adapted = peft.PeftModel.from_pretrained(ckpt.transformers_own_model(tmp_path / kind), adapter).eval()
    else:
        base = ckpt.reference_model(float_dir, dequantized)
        adapted = peft.PeftModel.from_pretrained(ckpt.reference_model(float_dir, dequantized), adapter)
        adapted = adapted.merge_and_unload().eval()
    # Quantizing inputs is discontinuous: compare prompts without near-ties on either side.
    prompts = clear_prompts(adapted, clear_prompts(base, PROMPTS)) if inputs_quantized else PROMPTS
    assert len(prompts) >= 2
    with_adapter = [hf_greedy(adapted, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    without = [hf_greedy(base, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    assert with_adapter != without  # the adapter changes the tokens

    llm = LLM(str(tmp_path / kind), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    request = LoRARequest("adapter", 1, adapter)
    requests = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(requests * 2, params, lora_request=[request] * len(prompts) + [None] * len(prompts),
                           use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == with_adapter + without
    wrapped = [module for module in ckpt.engine_model(llm).modules() if isinstance(module, BatchedLoRALinear)]
    assert wrapped and all(isinstance(module.base_layer, QuantizedLinear) for module in wrapped
                           if module.out_features != 512)
    bases = [module.base_layer for module in wrapped if isinstance(module.base_layer, QuantizedLinear)]
    stored = [base.weight if base.layout == "w8" else base.packed for base in bases]
    assert bases and all(tensor is not None and tensor.dtype == stored_dtype for tensor in stored)
    assert {base.input_quantization for base in bases} == {"int8" if inputs_quantized else "none"}
