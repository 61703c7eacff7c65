"""gpt-oss MXFP4 experts kept MXFP4: the tile-by-tile product against the layout's
reference, greedy tokens against transformers' own MXFP4 dequantization and against
the reference-dequantized model, memory held as uint8, broken checkpoints refused."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.utils.quantization_config import Mxfp4Config

from shardline import LLM, SamplingParams
from shardline.engine.kernels import triton_available
from shardline.engine.kernels.quant_reference import dequantize_mxfp4
from shardline.engine.quantization import mxfp4
from shardline.engine.quantization.checkpoint import CheckpointTensors, QuantizedCheckpointError
from shardline.engine.quantization.experts import QuantizedExperts, replace_quantized_experts
from shardline.engine.quantization.linear import dequantized_reference
from shardline.engine.quantization.methods import parse_quantization_config

from .moe_checkpoints import write_gpt_oss_mxfp4

PROMPTS = [[5, 9, 33, 70, 100, 7, 8, 200], [6, 10, 34, 71, 101, 7, 8, 200], [300, 12, 45]]


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> Path:
    return write_gpt_oss_mxfp4(tmp_path_factory.mktemp("gpt-oss-mxfp4"))


def _scheme(path: Path):
    return parse_quantization_config(json.loads((path / "config.json").read_text())["quantization_config"])


def _transformers_dequantized(path: Path) -> transformers.PreTrainedModel:
    """transformers' own reading of the checkpoint, its experts dequantized to float32."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32).eval()


def _reference_dequantized(path: Path) -> transformers.PreTrainedModel:
    """The same checkpoint with its experts dequantized by quant_reference.dequantize_mxfp4."""
    config_dict = json.loads((path / "config.json").read_text())
    config_dict.pop("quantization_config")
    config = transformers.AutoConfig.for_model(**config_dict)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    stored = load_file(path / "model.safetensors")
    state = {name: tensor for name, tensor in stored.items() if not name.endswith(("_blocks", "_scales"))}
    for name in stored:
        if name.endswith("_blocks"):
            weight = name.removesuffix("_blocks")
            state[weight] = dequantize_mxfp4(stored[name], stored[f"{weight}_scales"]).transpose(1, 2)
    model.load_state_dict(state, strict=True)
    return model


def _with_quantized_experts(model: transformers.PreTrainedModel, path: Path) -> transformers.PreTrainedModel:
    ours = copy.deepcopy(model)
    assert replace_quantized_experts(ours, CheckpointTensors(path), _scheme(path)) == ours.config.num_hidden_layers
    return ours


def _greedy(model: transformers.PreTrainedModel, prompt: list[int], new_tokens: int = 12) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),  # pyright: ignore[reportCallIssue]
                             max_new_tokens=new_tokens, do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_matmul_dequantizes_tile_by_tile_as_the_reference(monkeypatch) -> None:
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 70, 3, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(118, 134, (3, 70, 3), generator=generator, dtype=torch.uint8)
    weights = mxfp4.Mxfp4ExpertWeights(blocks, scales)
    monkeypatch.setattr(mxfp4, "TILE_ELEMENTS", 96 * 16)  # tiles of 16 rows, the last one partial
    x = torch.randn(5, 96, generator=generator)
    reference = dequantize_mxfp4(blocks, scales)
    for expert in range(3):
        expected = x @ reference[expert].t()
        tolerance = 1e-5 * float(expected.abs().max())
        torch.testing.assert_close(weights.tile_matmul(expert, x), expected, rtol=1e-5, atol=tolerance)
        torch.testing.assert_close(weights.matmul(expert, x), expected, rtol=1e-5, atol=tolerance)
        torch.testing.assert_close(weights.dequantize_rows(expert, 16, 40), reference[expert, 16:40], rtol=0, atol=0)


def test_greedy_tokens_match_transformers_mxfp4_and_the_reference(gpt_oss_dir) -> None:
    hf = _transformers_dequantized(gpt_oss_dir)
    reference = _reference_dequantized(gpt_oss_dir)
    ours = _with_quantized_experts(hf, gpt_oss_dir)
    outputs = []
    for prompt in PROMPTS:
        expected = _greedy(hf, prompt)
        assert _greedy(reference, prompt) == expected
        assert _greedy(ours, prompt) == expected, prompt
        outputs.append(expected)
    assert len({tuple(tokens) for tokens in outputs}) == len(PROMPTS)  # the tokens depend on the input


def test_engine_generates_transformers_greedy_tokens(gpt_oss_dir) -> None:
    hf = _transformers_dequantized(gpt_oss_dir)
    expected = [_greedy(hf, prompt) for prompt in PROMPTS]
    llm = LLM(str(gpt_oss_dir), dtype="float32", max_num_seqs=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    model = llm.llm_engine.model  # pyright: ignore[reportAttributeAccessIssue]
    assert sum(isinstance(module, QuantizedExperts) for module in model.modules()) == hf.config.num_hidden_layers


def test_dequantized_reference_switches_the_experts_and_their_mxfp4_projections(gpt_oss_dir) -> None:
    """The load check's reference: each expert's projection is x times the whole weight
    dequantized by quant_reference (no C or Triton kernel), switched back after."""
    ours = _with_quantized_experts(_reference_dequantized(gpt_oss_dir), gpt_oss_dir)
    switched = [module for module in ours.modules() if isinstance(module, (QuantizedExperts, mxfp4.Mxfp4ExpertWeights))]
    assert len(switched) == 3 * ours.config.num_hidden_layers  # each layer's experts, gate_up and down
    projection = next(module for module in switched if isinstance(module, mxfp4.Mxfp4ExpertWeights))
    x = torch.randn(20, projection.in_features, generator=torch.Generator().manual_seed(3))
    with dequantized_reference(ours):
        assert all(module.use_reference for module in switched)
        for expert in range(projection.num_experts):
            expected = x @ dequantize_mxfp4(projection.blocks[expert], projection.scales[expert]).t()
            assert torch.equal(projection.matmul(expert, x), expected)
    assert not any(module.use_reference for module in switched)


def test_bfloat16_gpt_oss_passes_the_load_check(gpt_oss_dir) -> None:
    llm = LLM(str(gpt_oss_dir), dtype="bfloat16", device="cpu", max_num_seqs=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 4


def test_experts_are_held_as_mxfp4(gpt_oss_dir) -> None:
    ours = _with_quantized_experts(_transformers_dequantized(gpt_oss_dir), gpt_oss_dir)
    config = ours.config
    experts = [module for module in ours.modules() if isinstance(module, QuantizedExperts)]
    assert len(experts) == config.num_hidden_layers
    for module in experts:
        assert not list(module.parameters())
        float_tensors = {name: tuple(tensor.shape) for name, tensor in module.named_buffers()
                         if tensor.dtype.is_floating_point}
        # Only the biases and the two 256-entry lookup tables are float.
        assert float_tensors == {
            "gate_up_bias": (4, 2 * config.intermediate_size), "down_bias": (4, config.hidden_size),
            "gate_up.pair_values": (256, 2), "gate_up.exponents": (256,),
            "down.pair_values": (256, 2), "down.exponents": (256,)}
        assert isinstance(module.gate_up, mxfp4.Mxfp4ExpertWeights)
        assert module.gate_up.blocks.dtype == module.gate_up.scales.dtype == torch.uint8
        assert tuple(module.gate_up.blocks.shape) == (4, 2 * config.intermediate_size, config.hidden_size // 32, 16)


# Run in a fresh interpreter: TRITON_INTERPRET must be set before triton is imported,
# and transformers (imported by this module) imports it.
KERNEL_WIRING = """
import torch
from shardline.engine.kernels.quant_moe import GatedActivation
from shardline.engine.quantization.experts import QuantizedExperts
from shardline.engine.quantization.mxfp4 import Mxfp4ExpertWeights

generator = torch.Generator().manual_seed(0)
experts, hidden, intermediate, tokens = 4, 64, 32, 7

def projection(rows, cols):
    return Mxfp4ExpertWeights(
        torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=generator, dtype=torch.uint8),
        torch.randint(120, 128, (experts, rows, cols // 32), generator=generator, dtype=torch.uint8))

module = QuantizedExperts(projection(2 * intermediate, hidden), projection(hidden, intermediate),
                          GatedActivation.clamped_swiglu(1.702, 7.0),
                          torch.randn(experts, 2 * intermediate, generator=generator),
                          torch.randn(experts, hidden, generator=generator))
x = torch.randn(tokens, hidden, generator=generator)
top_k_index = torch.tensor([[0, 2], [1, 2], [3, 0], [2, 4], [1, 3], [0, 1], [2, 3]])  # 4: not an expert here
top_k_weights = torch.rand(tokens, 2, generator=generator)
expected = module(x, top_k_index, top_k_weights)  # the CPU path
actual = module.kernel_forward(x, top_k_index, top_k_weights)
torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
print("kernel path agrees")
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_the_cuda_path_hands_the_mxfp4_kernel_what_the_cpu_path_computes() -> None:
    result = subprocess.run([sys.executable, "-c", KERNEL_WIRING], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0 and "kernel path agrees" in result.stdout, result.stderr[-3000:]


def _broken_copy(source: Path, target: Path, edit) -> Path:
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.pop("model.layers.1.mlp.experts.down_proj_scales"),
     "no tensor 'model.layers.1.mlp.experts.down_proj_scales'"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_scales":
                         t["model.layers.0.mlp.experts.gate_up_proj_scales"].to(torch.int32)}),
     "MXFP4 tensor model.layers.0.mlp.experts.gate_up_proj_scales is torch.int32; expected torch.uint8"),
    (lambda t: t.update({"model.layers.0.mlp.experts.down_proj_blocks":
                         t["model.layers.0.mlp.experts.down_proj_blocks"][:, :-1].contiguous()}),
     "MXFP4 tensor model.layers.0.mlp.experts.down_proj_blocks has shape (4, 63, 2, 16); expected (4, 64, 2, 16)"),
], ids=["missing-scale", "scale-dtype", "blocks-shape"])
def test_broken_checkpoints_are_refused_naming_the_tensor(gpt_oss_dir, tmp_path, edit, message) -> None:
    broken = _broken_copy(gpt_oss_dir, tmp_path / "broken", edit)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(gpt_oss_dir))
    with pytest.raises(QuantizedCheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        replace_quantized_experts(model, CheckpointTensors(broken), _scheme(broken))
