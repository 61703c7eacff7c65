"""LoRA adapters on a quantized base: the base linears stay quantized and each
request's adapter delta is added on top, token for token as transformers' generate of
the dequantized model with the adapter merged."""

from __future__ import annotations

import peft
import torch

from shardline import LLM, LoRARequest, SamplingParams
from shardline.engine.lora.layers import BatchedLoRALinear
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.quantization.linear import QuantizedLinear

from ..hf_reference import hf_greedy, random_prompts
from ..lora.test_lora import make_adapter
from . import checkpoints as ckpt

PROMPTS = random_prompts(4, (3, 20), 512, seed=11)
MAX_NEW_TOKENS = 8


def test_lora_on_a_gptq_base(tmp_path):
    float_dir = build_tiny_model(tmp_path / "float", "llama")
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    dequantized = ckpt.write_quantized(float_dir, tmp_path / "gptq", config, ckpt.gptq(32, True))
    adapter = make_adapter(str(float_dir), tmp_path / "adapter", seed=5, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj", "down_proj"])
    base = ckpt.reference_model(float_dir, dequantized)
    merged = peft.PeftModel.from_pretrained(ckpt.reference_model(float_dir, dequantized), adapter)
    merged = merged.merge_and_unload().eval()
    with_adapter = [hf_greedy(merged, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    without = [hf_greedy(base, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    assert with_adapter != without  # the adapter changes the tokens

    llm = LLM(str(tmp_path / "gptq"), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    request = LoRARequest("adapter", 1, adapter)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = llm.generate(prompts * 2, params, lora_request=[request] * len(PROMPTS) + [None] * len(PROMPTS),
                           use_tqdm=False)
    tokens = [output.outputs[0].token_ids for output in outputs]
    assert tokens == with_adapter + without
    wrapped = [module for module in ckpt.engine_model(llm).modules() if isinstance(module, BatchedLoRALinear)]
    assert wrapped and all(isinstance(module.base_layer, QuantizedLinear) for module in wrapped
                           if module.out_features != 512)
    assert any(isinstance(module.base_layer, QuantizedLinear) and module.base_layer.packed is not None
               and module.base_layer.packed.dtype == torch.uint8 for module in wrapped)
