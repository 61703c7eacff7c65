"""Online quantization: ``LLM(model, quantization="fp8" | "int8")`` quantizes a float
checkpoint's decoder linears at load, per output channel, and runs token for token as
transformers' generate with those weights dequantized."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.quantization.linear import quantized_linears

from ..hf_reference import hf_greedy, random_prompts
from . import checkpoints as ckpt
from .checkpoints import decoder_linears, reference_model
from .test_formats import MAX_NEW_TOKENS, assert_kept_quantized

PROMPTS = random_prompts(5, (2, 30), 512, seed=7)


def _per_channel(weight: torch.Tensor, method: str) -> torch.Tensor:
    """The dequantized per-channel symmetric fp8 (e4m3, largest 448) or int8 (127) weight."""
    largest = 448.0 if method == "fp8" else 127.0
    scale = weight.abs().amax(dim=1, keepdim=True) / largest
    if method == "fp8":
        return (weight / scale).to(torch.float8_e4m3fn).float() * scale
    return (weight / scale).round().clamp(-127, 127) * scale


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("float"), "qwen3")


@pytest.mark.parametrize("method,dtype", [("fp8", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_online_quantization_matches_dequantized_transformers(method, dtype, float_dir):
    state = load_file(str(float_dir / "model.safetensors"))
    modules = decoder_linears(state)
    dequantized = {module: _per_channel(state[f"{module}.weight"].float(), method) for module in modules}
    for module in modules:  # the quantized model is near the float one, but not equal to it
        error = (dequantized[module] - state[f"{module}.weight"]).abs().max() / state[f"{module}.weight"].abs().max()
        assert 0 < float(error) < (0.07 if method == "fp8" else 0.005)
    reference = reference_model(float_dir, dequantized)
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    llm = LLM(str(float_dir), dtype="float32", device="cpu", quantization=method)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    model = ckpt.engine_model(llm)
    assert_kept_quantized(model, modules, dtype)
    assert all(".layers." in name for name, _ in quantized_linears(model))  # the lm_head stays float


@pytest.mark.parametrize("setting", ["on", "off"])
def test_both_cpu_paths_match_dequantized_transformers(setting, float_dir, monkeypatch):
    """SHARDLINE_CPU_PATHS=quant_kernels=on|off: the quantized linears run through the C
    kernels or through torch's dequantized tiles, and either way give transformers'
    tokens; with six prompts at once the decode steps multiply several rows."""
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", f"quant_kernels={setting}")
    state = load_file(str(float_dir / "model.safetensors"))
    modules = decoder_linears(state)
    reference = reference_model(float_dir, {m: _per_channel(state[f"{m}.weight"].float(), "int8") for m in modules})
    prompts = random_prompts(6, (2, 30), 512, seed=11)
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    llm = LLM(str(float_dir), dtype="float32", device="cpu", quantization="int8")
    assert llm.llm_engine.cpu_paths.quant_kernels == (setting == "on")
    layers = [layer for _, layer in quantized_linears(ckpt.engine_model(llm))]
    assert layers and all(layer.cpu_kernels == (setting == "on") for layer in layers)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
