"""Quantized MoE experts split over ranks with their scales: the ranks' partial outputs
sum to the whole experts' (MXFP4 in whole 32-element blocks, FP8 blocks, int4 and int8
groups, shares uneven where the blocks do not divide), a split that would leave a rank
without a whole block is refused naming the module, and quantized MoE checkpoints on 2
gloo ranks give 1 rank's and transformers' greedy tokens (gpt-oss MXFP4, Qwen3-MoE)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers
from accelerate import init_empty_weights
from torch import nn
from transformers.utils.quantization_config import Mxfp4Config

from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.parallel.experts import expert_share, split_quantized_experts
from shardline.engine.parallel.group import RankGroup, ShardingError
from shardline.engine.parallel.layers import ReducedOutput
from shardline.engine.quantization.checkpoint import CheckpointTensors
from shardline.engine.quantization.experts import QuantizedExperts, replace_quantized_experts
from shardline.engine.quantization.methods import parse_quantization_config

from ..quantization import checkpoints as ckpt
from ..quantization.moe_checkpoints import fused_reference_model, write_gpt_oss_mxfp4
from .test_quantized import two_ranks_match

# Per format: (quantization_config, the checkpoint writer).
FORMATS = {
    "fp8_channel": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, ckpt.fp8_per_channel),
    "fp8_block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [16, 32]}, ckpt.fp8_blocks((16, 32))),
    "gptq_int4": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
                   "checkpoint_format": "gptq"}, ckpt.gptq(32, False)),
    "gptq_int8_act_order": ({"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": True, "sym": True,
                             "checkpoint_format": "gptq"}, ckpt.gptq_8bit(32, act_order=True)),
    "w8a16_asymmetric_groups": (ckpt.pack_quantized_int8_config(32, False), ckpt.pack_quantized_int8(32, False)),
}


def qwen3_moe(path: Path, intermediate: int) -> Path:
    return build_tiny_model(path, "qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=intermediate, norm_topk_prob=True)


def quantized_experts(directory: Path) -> QuantizedExperts:
    """The first layer's experts as the loader holds them (replace_quantized_experts)."""
    config = transformers.AutoConfig.from_pretrained(directory)
    scheme = parse_quantization_config(json.loads((directory / "config.json").read_text())["quantization_config"])
    delattr(config, "quantization_config")
    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    replace_quantized_experts(model, CheckpointTensors(directory), scheme)
    experts = model.get_submodule("model.layers.0.mlp.experts")
    assert isinstance(experts, QuantizedExperts)
    return experts


def summed_shares(experts: QuantizedExperts, size: int, x: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ranks' partial outputs summed, as ReducedOutput's all-reduce sums them."""
    total = torch.zeros_like(x)
    for rank in range(size):
        share = split_quantized_experts(copy.deepcopy(experts), "experts", RankGroup(rank, size, lambda: ""))
        assert isinstance(share, ReducedOutput) and isinstance(share.inner, QuantizedExperts)
        total += share.inner(x, top_k_index, top_k_weights)
    return total


def check_shares_sum(experts: QuantizedExperts, sizes: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(3)
    hidden = experts.down.out_features
    x = torch.randn(9, hidden, generator=generator)
    top_k_index = torch.randint(0, experts.num_experts, (9, 2), generator=generator)
    top_k_weights = torch.rand(9, 2, generator=generator)
    whole = experts(x, top_k_index, top_k_weights)
    assert whole.abs().max() > 0.1
    for size in sizes:
        torch.testing.assert_close(summed_shares(experts, size, x, top_k_index, top_k_weights), whole,
                                   rtol=1e-5, atol=1e-5 * float(whole.abs().max()))


def test_expert_shares_deal_out_whole_blocks():
    shares = [expert_share(96, 32, RankGroup(rank, 2, lambda: ""), "experts") for rank in range(2)]
    assert shares == [(0, 64), (64, 96)]
    shares = [expert_share(100, 32, RankGroup(rank, 4, lambda: ""), "experts") for rank in range(4)]
    assert shares == [(0, 32), (32, 64), (64, 96), (96, 100)]  # the last block partial
    with pytest.raises(ShardingError, match=r"experts: its experts' intermediate size 64 holds 2 whole units "
                                            r"of 32 \(scale blocks, or 8 for float experts\), fewer than the 3 ranks"):
        expert_share(64, 32, RankGroup(0, 3, lambda: ""), "experts")


def test_mxfp4_shares_sum_to_the_whole_experts(tmp_path):
    """gpt-oss's interleaved gate_up rows and down's 32-element blocks: 3 blocks over 2
    ranks (uneven) and over 3; the biases' sum counted once."""
    experts = quantized_experts(write_gpt_oss_mxfp4(tmp_path / "gpt-oss", intermediate_size=96))
    assert experts.gate_up_bias is not None and experts.down_bias is not None
    check_shares_sum(experts, (2, 3))
    share = split_quantized_experts(experts, "experts", RankGroup(1, 2, lambda: "")).inner
    assert isinstance(share, QuantizedExperts) and share.down_bias is None  # added once, on rank 0
    with pytest.raises(ShardingError, match=r"model.layers.0.mlp.experts: .* 3 whole units of 32 .*, fewer "
                                            "than the 4 ranks"):
        split_quantized_experts(experts, "model.layers.0.mlp.experts", RankGroup(0, 4, lambda: ""))


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block", "gptq_int4", "w8a16_asymmetric_groups"])
def test_per_expert_shares_sum_to_the_whole_experts(tmp_path, fmt):
    quantization_config, quantize = FORMATS[fmt]
    float_dir = qwen3_moe(tmp_path / "float", 96)
    ckpt.write_quantized(float_dir, tmp_path / fmt, quantization_config, quantize)
    check_shares_sum(quantized_experts(tmp_path / fmt), (2, 3))


def test_act_order_groups_mixing_the_ranks_inputs_are_refused(tmp_path):
    """down's act-order groups gather input columns from both ranks' shares."""
    quantization_config, quantize = FORMATS["gptq_int8_act_order"]
    float_dir = qwen3_moe(tmp_path / "float", 96)
    ckpt.write_quantized(float_dir, tmp_path / "int8", quantization_config, quantize)
    experts = quantized_experts(tmp_path / "int8")
    with pytest.raises(ShardingError, match=r"experts\.down\.0\.down_proj: its act-order \(g_idx\) groups mix"):
        split_quantized_experts(experts, "experts", RankGroup(0, 2, lambda: ""))


def check_two_ranks(reference: transformers.PreTrainedModel, quantized_dir: Path) -> None:
    """2 ranks and 1 give the dequantized transformers model's greedy tokens, which
    depend on the prompt; the ranks hold quantized shares of the experts."""
    def holds_expert_shares(model: nn.Module) -> bool:
        shares = [module.inner for module in model.modules() if isinstance(module, ReducedOutput)]
        return bool(shares) and all(isinstance(share, QuantizedExperts) for share in shares)

    two_ranks_match(reference, quantized_dir, holds_expert_shares, num_short=3)


def test_gpt_oss_mxfp4_on_two_ranks(tmp_path):
    path = write_gpt_oss_mxfp4(tmp_path / "gpt-oss")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    check_two_ranks(reference, path)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8_block", "gptq_int4"])
def test_qwen3_moe_quantized_experts_on_two_ranks(tmp_path, fmt):
    quantization_config, quantize = FORMATS[fmt]
    float_dir = qwen3_moe(tmp_path / "float", 64)
    dequantized = ckpt.write_quantized(float_dir, tmp_path / fmt, quantization_config, quantize)
    check_two_ranks(fused_reference_model(float_dir, dequantized), tmp_path / fmt)
