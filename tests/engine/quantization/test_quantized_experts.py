"""Quantized MoE experts from checkpoints that store each expert's linears apart
(Qwen3-MoE FP8 blocks with ``weight_scale_inv``, compressed-tensors W4A16, GPTQ int4):
greedy tokens through the engine against transformers (its own FP8 loader, and the
float model with the dequantized weights fused as it holds them), the experts held
quantized, and the refusals of experts the engine cannot hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from accelerate import init_empty_weights

from shardline import LLM, SamplingParams
from shardline.engine.errors import UnsupportedModelError
from shardline.engine.kernels import triton_available
from shardline.engine.quantization.checkpoint import CheckpointTensors
from shardline.engine.quantization.experts import (
    LinearsPerExpert,
    QuantizedExperts,
    per_expert_names,
    replace_quantized_experts,
)
from shardline.engine.quantization.linear import QuantizedLinear
from shardline.engine.quantization.methods import parse_quantization_config

from . import checkpoints as ckpt
from .moe_checkpoints import fused_reference_model, tiny_moe, tiny_qwen3_moe, write_quantized_experts

PROMPTS = [[5, 9, 33, 70, 100, 7, 8, 200], [6, 10, 34, 71, 101, 7, 8, 200], [300, 12, 45]]
NEW_TOKENS = 12
FP8_BLOCK = (16, 32)

# Per format: (quantization_config, the checkpoint writer, the dtype the experts hold,
# whether gate_up and down are stacked over the experts for the grouped W8 kernel).
FORMATS = {
    "fp8_block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": list(FP8_BLOCK)}, ckpt.fp8_blocks(FP8_BLOCK), torch.float8_e4m3fn,
                  (True, True)),
    "compressed_w4a16": (ckpt.compressed_config("pack-quantized", {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}),
        ckpt.pack_quantized(32, True), torch.uint8, (False, False)),
    "gptq_int4": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
                   "checkpoint_format": "gptq"}, ckpt.gptq(32, True), torch.uint8, (False, False)),
    # Act-order columns (an input_perm per expert) keep gate_up's linears apart; down's
    # 32 columns are one group, in order, so it stacks.
    "gptq_int8_act_order": ({"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": True, "sym": True,
                             "checkpoint_format": "gptq"}, ckpt.gptq_8bit(32, act_order=True), torch.int8,
                            (False, True)),
    # Zero points: the grouped W8 kernel reads none, so each expert's linears stay apart.
    "compressed_int8_asymmetric": (ckpt.compressed_config("int-quantized", {
        "num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}),
        ckpt.int8_asymmetric(per_channel=True), torch.int8, (False, False)),
    # 8-bit pack-quantized (W8A16): per channel, stacked for the grouped W8 kernel; by
    # groups with zero points, each expert's linears apart.
    "compressed_w8a16_channel": (ckpt.pack_quantized_int8_config(None, True), ckpt.pack_quantized_int8(None, True),
                                 torch.int8, (True, True)),
    "compressed_w8a16_asymmetric_groups": (ckpt.pack_quantized_int8_config(32, False),
                                           ckpt.pack_quantized_int8(32, False), torch.int8, (False, False)),
}
# Their experts are read by the same reader as test_formats.py's linears of the format.
SLOW_FORMATS = ("compressed_w8a16_channel", "compressed_w8a16_asymmetric_groups")


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    return tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe-float"))


def _greedy_hf(model: transformers.PreTrainedModel, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),  # pyright: ignore[reportCallIssue]
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def _greedy_engine(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _experts(llm: LLM) -> list[QuantizedExperts]:
    model = llm.llm_engine.model  # pyright: ignore[reportAttributeAccessIssue]
    return [module for module in model.modules() if isinstance(module, QuantizedExperts)]


@pytest.mark.parametrize("fmt", [pytest.param(fmt, marks=pytest.mark.slow) if fmt in SLOW_FORMATS else fmt
                                 for fmt in FORMATS])
def test_greedy_tokens_match_transformers_with_experts_kept_quantized(float_dir, tmp_path, fmt) -> None:
    quantization_config, quantize, stored_dtype, stacked_over_experts = FORMATS[fmt]
    out_dir = tmp_path / fmt
    dequantized = ckpt.write_quantized(float_dir, out_dir, quantization_config, quantize)
    assert any(".experts.3.down_proj" in name for name in dequantized)
    expected = [_greedy_hf(fused_reference_model(float_dir, dequantized), prompt) for prompt in PROMPTS]
    assert len({tuple(tokens) for tokens in expected}) == len(PROMPTS)  # the tokens depend on the input
    if fmt == "fp8_block":  # transformers' own FP8 loader (it dequantizes on CPU) agrees
        hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
        assert [_greedy_hf(hf, prompt) for prompt in PROMPTS] == expected

    llm = LLM(str(out_dir), dtype="float32", max_num_seqs=4)
    assert _greedy_engine(llm) == expected
    experts = _experts(llm)
    assert len(experts) == 2
    for module in experts:
        assert not list(module.parameters())
        for projection in (module.gate_up, module.down):
            assert isinstance(projection, LinearsPerExpert) and projection.num_experts == 4
            linears = [linear for linear in projection.modules() if isinstance(linear, QuantizedLinear)]
            stacked = projection.stacked_weight
            if not stacked_over_experts[1 if projection is module.down else 0]:  # each expert's linears apart
                assert stacked is None and len(linears) == 4 * (2 if projection is module.gate_up else 1)
            else:  # W8: stacked over the experts (gate and up rows together), each expert a view
                assert stacked is not None and stacked.shape == (4, projection.out_features, projection.in_features)
                assert len(linears) == 4 and all(
                    linear.weight is not None and linear.weight.untyped_storage().data_ptr()
                    == stacked.untyped_storage().data_ptr() for linear in linears)
            for linear in linears:
                stored = linear.weight if linear.layout == "w8" else linear.packed
                assert stored is not None and stored.dtype == stored_dtype
                # No 16/32-bit float tensor as large as the weight: scales and zero points only.
                weight_elements = linear.in_features * linear.out_features
                assert all(buffer.numel() < weight_elements // 8 for buffer in linear.buffers()
                           if buffer.dtype.is_floating_point and buffer.element_size() > 1)


FP8_SMALL_BLOCKS = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [8, 8]}


def test_deepseek_v3_fp8_block_experts(tmp_path) -> None:
    """Every linear FP8 with weight_scale_inv (latent attention, a dense first layer and
    shared experts beside the routed ones), as DeepSeek-V3's checkpoints are."""
    float_dir = tiny_moe(tmp_path / "float", "deepseek_v3")
    out_dir = tmp_path / "fp8"
    dequantized = ckpt.write_quantized(float_dir, out_dir, FP8_SMALL_BLOCKS, ckpt.fp8_blocks((8, 8)))
    assert any(".experts.3." in name for name in dequantized)
    expected = [_greedy_hf(fused_reference_model(float_dir, dequantized), prompt) for prompt in PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert [_greedy_hf(hf, prompt) for prompt in PROMPTS] == expected
    llm = LLM(str(out_dir), dtype="float32", max_num_seqs=4)
    assert _greedy_engine(llm) == expected
    assert len(_experts(llm)) == 1  # the second layer's; the first is dense


def test_mixtral_experts_read_under_their_checkpoint_names(tmp_path) -> None:
    """Mixtral's checkpoints keep experts as block_sparse_moe.experts.{e}.w1/w3/w2, which
    transformers renames and fuses into mlp.experts; read from there, each layer's
    experts compute the reference model's."""
    float_dir = tiny_moe(tmp_path / "float", "mixtral")
    out_dir = tmp_path / "fp8"
    dequantized = write_quantized_experts(float_dir, out_dir, FP8_SMALL_BLOCKS, ckpt.fp8_blocks((8, 8)))
    assert "model.layers.1.block_sparse_moe.experts.3.w2" in dequantized
    reference = fused_reference_model(float_dir, dequantized)
    model = _skeleton(out_dir)
    assert replace_quantized_experts(model, CheckpointTensors(out_dir), _scheme(out_dir)) == 2
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, reference.config.hidden_size, generator=generator)
    top_k_index = torch.randint(0, 4, (9, 2), generator=generator)
    top_k_weights = torch.rand(9, 2, generator=generator)
    for layer in range(2):
        ours = model.get_submodule(f"model.layers.{layer}.mlp.experts")
        assert isinstance(ours, QuantizedExperts)
        with torch.no_grad():
            expected = reference.get_submodule(f"model.layers.{layer}.mlp.experts")(hidden, top_k_index, top_k_weights)
            torch.testing.assert_close(ours(hidden, top_k_index, top_k_weights), expected, rtol=1e-5, atol=1e-5)


# Run in a fresh interpreter: TRITON_INTERPRET must be set before triton is imported,
# and transformers (imported by this module) imports it.
W8_KERNEL_WIRING = """
import sys
import torch
from torch import nn
from shardline.engine.quantization.experts import QuantizedExperts, SiluGatedHalves, stack_w8
from shardline.engine.quantization.linear import QuantizedLinear

block = None if sys.argv[1] == "tensor" else (16, 32)
generator = torch.Generator().manual_seed(0)
experts, hidden, intermediate, tokens = 4, 64, 32, 7

def linear(rows, cols):
    weight = (torch.randn(rows, cols, generator=generator) * 100).to(torch.float8_e4m3fn)
    grid = (1, 1) if block is None else (-(-rows // block[0]), -(-cols // block[1]))
    return QuantizedLinear.w8(weight, torch.rand(*grid, generator=generator) / 200 + 1e-3, block)

gate_up = stack_w8({part: [linear(intermediate, hidden) for _ in range(experts)] for part in ("gate", "up")})
down = stack_w8({"down": [linear(hidden, intermediate) for _ in range(experts)]})
assert gate_up.stacked_weight is not None and down.stacked_weight is not None
module = QuantizedExperts(gate_up, down, SiluGatedHalves(nn.SiLU()))
x = torch.randn(tokens, hidden, generator=generator)
top_k_index = torch.tensor([[0, 2], [1, 2], [3, 0], [2, 4], [1, 3], [0, 1], [2, 3]])  # 4: not an expert here
top_k_weights = torch.rand(tokens, 2, generator=generator)
expected = module(x, top_k_index, top_k_weights)  # the CPU path
actual = module.kernel_forward(x, top_k_index, top_k_weights)
torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
print("kernel path agrees")
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("scales", ["tensor", "block"])
def test_the_cuda_path_hands_the_w8_kernel_what_the_cpu_path_computes(scales) -> None:
    result = subprocess.run([sys.executable, "-c", W8_KERNEL_WIRING, scales], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0 and "kernel path agrees" in result.stdout, result.stderr[-3000:]


def test_transformers_weight_conversion_names_each_experts_linears() -> None:
    assert per_expert_names("qwen3_moe") == (("gate_proj", "up_proj"), ("down_proj",), ())
    assert per_expert_names("deepseek_v3") == (("gate_proj", "up_proj"), ("down_proj",), ())
    # Mixtral's checkpoints name them w1/w3/w2 under block_sparse_moe, which transformers renames to mlp.
    assert per_expert_names("mixtral") == (("w1", "w3"), ("w2",), ((".block_sparse_moe.", ".mlp."),))


def _skeleton(directory: Path) -> transformers.PreTrainedModel:
    config = json.loads((directory / "config.json").read_text())
    config.pop("quantization_config", None)
    with init_empty_weights(include_buffers=False):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))


def _scheme(directory: Path):
    return parse_quantization_config(json.loads((directory / "config.json").read_text())["quantization_config"])


def test_mxfp4_experts_of_another_model_type_are_refused(float_dir, tmp_path) -> None:
    def as_mxfp4(name: str, weight: torch.Tensor) -> ckpt.Written:
        rows, cols = weight.shape
        return {"weight_blocks": torch.zeros(rows, cols // 32, 16, dtype=torch.uint8),
                "weight_scales": torch.full((rows, cols // 32), 127, dtype=torch.uint8)}, weight

    out_dir = tmp_path / "mxfp4"
    ckpt.write_quantized(float_dir, out_dir, {"quant_method": "mxfp4"}, as_mxfp4,
                         modules=lambda names: [name for name in names if ".experts." in name])
    refusal = r"model type 'qwen3_moe' \(Qwen3MoeExperts at model.layers.0.mlp.experts\) quantized as mxfp4 "
    with pytest.raises(UnsupportedModelError, match=refusal + "are not supported"):
        replace_quantized_experts(_skeleton(out_dir), CheckpointTensors(out_dir), _scheme(out_dir))


def test_quantized_experts_of_an_unknown_experts_module_are_refused(float_dir, tmp_path) -> None:
    out_dir = tmp_path / "renamed"
    ckpt.write_quantized(float_dir, out_dir, FORMATS["fp8_block"][0], ckpt.fp8_blocks(FP8_BLOCK))
    tensors = CheckpointTensors(out_dir)
    model = _skeleton(out_dir)
    # The checkpoint's experts under a name no experts module of the model answers to.
    del model.model.layers[1].mlp.experts
    with pytest.raises(UnsupportedModelError, match=r"model type 'qwen3_moe' quantized as fp8 \(fp8\) "
                                                    r"\(model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"):
        replace_quantized_experts(model, tensors, _scheme(out_dir))
