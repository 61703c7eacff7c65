"""A tensor-parallel rank reads only its share of a quantized checkpoint's linears: for
every on-disk layout (FP8 per tensor, channel and block, compressed-tensors FP8, INT8
(asymmetric per channel, tensor and group), W4A16 and W8A16 (packed 8-bit codes, asymmetric
groups), GPTQ 4- and 8-bit, AWQ), each rank's shares read slice by slice dequantize to the
shares split from the whole linears, with the same biases; linears a slice would cut (a
row split over act-order columns, a block wider than a share) are read whole, and the split
refuses them as without slices. Likewise quantized experts (MXFP4, per-expert FP8 and
GPTQ) and the checkpoint's float tensors (embedding, LM head, unquantized linears)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from shardline.engine.config import EngineConfig
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.loader import load_causal_lm
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.parallel.experts import RANK_SHARE, split_quantized_experts
from shardline.engine.parallel.group import RankGroup, ShardingError
from shardline.engine.parallel.layers import ReducedOutput
from shardline.engine.parallel.loading import SliceReader
from shardline.engine.parallel.placement import shard_then_place
from shardline.engine.parallel.quantized import RowParallelQuantized
from shardline.engine.parallel.quantized_slices import put_expert_shares, quantized_share_plan
from shardline.engine.parallel.sharding import shard_model
from shardline.engine.parallel.verdict import check_tensor_parallel, tensor_parallel_verdict
from shardline.engine.quantization.experts import QuantizedExperts
from shardline.engine.quantization.linear import QuantizedLinear
from shardline.engine.quantization.load import QuantizedWeights, load_quantized_model, put_quantized_linears
from shardline.engine.quantization.methods import resolve_scheme
from shardline.engine.quantization.mxfp4 import Mxfp4ExpertWeights

from ..quantization import checkpoints as ckpt
from ..quantization.moe_checkpoints import write_gpt_oss_mxfp4
from ..quantization.test_formats import FORMATS as ENGINE_FORMATS
from .test_quantized_experts import FORMATS as EXPERT_FORMATS


# Format: how many of its 14 linears (2 layers x q, k, v, o, gate, up, down) a rank reads as slices.
def _one_group_per_row(quantize_groups):
    """A quantizer of groups made one of a group over each weight's whole row."""
    return lambda name, weight: quantize_groups(weight.shape[1])(name, weight)


# test_formats.py's formats, and GPTQ with one group per row (group_size -1), whose row
# shares keep their one scale (and zero point) per row.
FORMATS = {**ENGINE_FORMATS, "gptq_8bit_one_group_per_row": (
    "llama", {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}, _one_group_per_row(ckpt.gptq_8bit), torch.int8),
    "gptq_int4_one_group_per_row": (
    "qwen3", {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": False,
              "checkpoint_format": "gptq"}, _one_group_per_row(lambda size: ckpt.gptq(size, False)), torch.uint8)}

SLICED = {
    "fp8_per_tensor_static": 14, "fp8_blocks_scale_inv": 14, "compressed_w4a16_symmetric": 14, "gptq_v2": 14,
    "gptq_8bit": 14, "awq_gemm_with_biases": 14, "fp8_channel_with_biases": 14,
    "compressed_int8_asymmetric_channel": 14, "compressed_int8_asymmetric_tensor_w8a8": 14,
    "compressed_int8_groups": 14, "compressed_int8_asymmetric_groups": 14, "compressed_w8a16_channel": 14,
    "compressed_w8a16_asymmetric_groups": 14, "gptq_8bit_one_group_per_row": 14,
    "gptq_int4_one_group_per_row": 14,
}


def loaded(directory: Path, read_experts: bool = True) -> tuple[nn.Module, QuantizedWeights]:
    """The loader's model of a quantized checkpoint (its quantized linears on the meta device)."""
    hf_config = transformers.AutoConfig.from_pretrained(directory)
    scheme = resolve_scheme(hf_config, None)
    assert scheme is not None
    return load_quantized_model(transformers.AutoModelForCausalLM, hf_config, directory, scheme, torch.float32,
                                torch.device("cpu"), "eager", read_experts=read_experts)


def attention_layers(model: nn.Module) -> int:
    config = model.config
    assert isinstance(config, transformers.PretrainedConfig)
    return sum(1 for layer in KVCacheSpec.from_hf_config(config, torch.float32).layers if layer.num_kv_heads)


def whole_split(directory: Path, group: RankGroup) -> nn.Module:
    """The whole checkpoint loaded with its quantized linears placed, then split for
    ``group``'s rank: what the slice-read shares are compared against."""
    whole, weights = loaded(directory)
    put_quantized_linears(whole, weights)
    shard_model(whole, group, attention_layers(whole))
    return whole


def dequantized(layer: QuantizedLinear) -> torch.Tensor:
    """A share's float32 weight in input-column order (act-order undone)."""
    weight = layer.dequantized_rows(0, layer.out_features)
    if layer.input_perm is None:
        return weight
    ordered = torch.empty_like(weight)
    ordered[:, layer.input_perm] = weight
    return ordered


def quantized_parts(model: nn.Module) -> dict[str, QuantizedLinear | RowParallelQuantized]:
    return {name: module for name, module in model.named_modules()
            if isinstance(module, (QuantizedLinear, RowParallelQuantized))}


@pytest.mark.parametrize("name", sorted(SLICED))
def test_slice_read_shares_equal_the_whole_linears_split(name, tmp_path):
    arch, config, quantize, _ = FORMATS[name]
    float_dir = build_tiny_model(tmp_path / "float", arch)
    directory = tmp_path / name
    ckpt.write_quantized(float_dir, directory, config, quantize)
    for rank in (0, 1):
        group = RankGroup(rank, 2, lambda: "")
        whole = whole_split(directory, group)
        sliced, weights = loaded(directory)
        assert len(quantized_share_plan(sliced, group, weights)) == SLICED[name]
        shard_then_place(sliced, group, attention_layers(sliced), torch.device("cpu"), quantized=weights)
        want, have = quantized_parts(whole), quantized_parts(sliced)
        assert sorted(want) == sorted(have) and len(want) >= 14
        for module_name, expected in want.items():
            got = have[module_name]
            assert type(got) is type(expected), module_name
            if isinstance(expected, RowParallelQuantized):
                assert isinstance(got, RowParallelQuantized)
                assert (got.bias is None) == (expected.bias is None)
                if expected.bias is not None and got.bias is not None:
                    assert torch.equal(got.bias, expected.bias), module_name
                continue  # its inner linear is compared on its own
            assert isinstance(got, QuantizedLinear) and isinstance(expected, QuantizedLinear)
            assert torch.equal(dequantized(got), dequantized(expected)), module_name
            assert (got.bias is None) == (expected.bias is None), module_name
            if expected.bias is not None and got.bias is not None:
                assert torch.equal(got.bias, expected.bias), module_name
            assert got.input_quantization == expected.input_quantization


@pytest.mark.parametrize(("name", "sliced", "refusal"), [
    ("compressed_w4a16_asymmetric_act_order", 10, r"o_proj: its act-order \(g_idx\) groups mix"),
    ("fp8_partial_blocks", 0, r"q_proj: a rank's share \[0, 32\) of its 64 output rows .* blocks of 48"),
])
def test_linears_a_slice_would_cut_are_read_whole_and_split_or_refused(name, sliced, refusal, tmp_path):
    """Act-order columns split by input, blocks wider than a share: read whole, and the
    split refuses them naming the layer as it does without slices."""
    arch, config, quantize, _ = FORMATS[name]
    ckpt.write_quantized(build_tiny_model(tmp_path / "float", arch), tmp_path / name, config, quantize)
    model, weights = loaded(tmp_path / name)
    group = RankGroup(0, 2, lambda: "")
    assert len(quantized_share_plan(model, group, weights)) == sliced
    with pytest.raises(ShardingError, match=refusal):
        shard_then_place(model, group, attention_layers(model), torch.device("cpu"), quantized=weights)


def test_mxfp4_expert_shares_read_as_slices_equal_the_whole_experts_split(tmp_path):
    """gpt-oss: each rank reads its share of the experts' blocks, scales and biases (3
    blocks of 32 over 2 ranks: 64 and 32 of the intermediate size)."""
    directory = write_gpt_oss_mxfp4(tmp_path / "gpt-oss", intermediate_size=96)
    for rank in (0, 1):
        group = RankGroup(rank, 2, lambda: "")
        whole, _ = loaded(directory)
        shard_model(whole, group, attention_layers(whole))
        sliced, weights = loaded(directory, read_experts=False)
        assert weights.experts_deferred
        shard_then_place(sliced, group, attention_layers(sliced), torch.device("cpu"), quantized=weights)
        want = {name: module.inner for name, module in whole.named_modules() if isinstance(module, ReducedOutput)}
        have = {name: module.inner for name, module in sliced.named_modules() if isinstance(module, ReducedOutput)}
        assert sorted(want) == sorted(have) and len(want) == 2
        for name, expected in want.items():
            got = have[name]
            assert isinstance(got, QuantizedExperts) and isinstance(expected, QuantizedExperts)
            assert got.down.in_features == (64 if rank == 0 else 32)
            for projection in ("gate_up", "down"):
                mine, theirs = getattr(got, projection), getattr(expected, projection)
                assert isinstance(mine, Mxfp4ExpertWeights) and isinstance(theirs, Mxfp4ExpertWeights)
                assert torch.equal(mine.blocks, theirs.blocks) and torch.equal(mine.scales, theirs.scales)
            for bias in ("gate_up_bias", "down_bias"):
                mine, theirs = getattr(got, bias), getattr(expected, bias)
                assert (mine is None) == (theirs is None) and (mine is None or torch.equal(mine, theirs)), bias
        assert not any(parameter.is_meta for parameter in sliced.parameters())


def expert_linears(model: nn.Module) -> dict[str, QuantizedLinear]:
    """Every expert linear of the ranks' experts shares, by name inside its share."""
    return {f"{name}.{inner}": linear for name, module in model.named_modules() if isinstance(module, ReducedOutput)
            for inner, linear in module.inner.named_modules() if isinstance(linear, QuantizedLinear)}


@pytest.mark.parametrize("fmt", ["fp8_block", pytest.param("gptq_int4", marks=pytest.mark.slow),
                                 "w8a16_asymmetric_groups"])
def test_per_expert_shares_read_as_slices_equal_the_whole_experts_split(fmt, tmp_path):
    """Qwen3-MoE with per-expert FP8 (16x32 blocks), GPTQ int4 or W8A16 asymmetric
    (groups of 32, 8-bit codes and zero points packed four to an int32) experts:
    each rank reads its gate/up rows and down columns with their scales (intermediate 96
    over 2 ranks: 64 and 32 in whole 32-column units), equal to the whole experts' split."""
    quantization_config, quantize = EXPERT_FORMATS[fmt]
    float_dir = build_tiny_model(tmp_path / "float", "qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=96, norm_topk_prob=True)
    directory = tmp_path / fmt
    ckpt.write_quantized(float_dir, directory, quantization_config, quantize)
    for rank in (0, 1):
        group = RankGroup(rank, 2, lambda: "")
        whole = whole_split(directory, group)
        sliced, weights = loaded(directory, read_experts=False)
        shard_then_place(sliced, group, attention_layers(sliced), torch.device("cpu"), quantized=weights)
        shares = [module.inner for module in sliced.modules() if isinstance(module, ReducedOutput)]
        assert len(shares) == 2 and all(getattr(share, RANK_SHARE, False) for share in shares)  # read as slices
        assert all(isinstance(share, QuantizedExperts) and share.down.in_features == (64 if rank == 0 else 32)
                   for share in shares)
        want, have = expert_linears(whole), expert_linears(sliced)
        assert sorted(want) == sorted(have) and len(want) >= 2 * 4 * 2
        for name, expected in want.items():
            assert torch.equal(dequantized(have[name]), dequantized(expected)), name
        assert not any(parameter.is_meta for parameter in sliced.parameters())


def rank_shard(directory: Path, rank: int, slices: bool) -> tuple[nn.Module, SliceReader]:
    """Rank ``rank`` of 2's shard of a quantized checkpoint as the engine loads it, its
    float parameters read as slices (``slices``) or whole before the split."""
    config = EngineConfig(model=str(directory), dtype="float32", tensor_parallel_size=2)
    reader = SliceReader()
    model = load_causal_lm(config, reader if slices else None)
    assert model.quantized is not None
    shard_then_place(model.model, RankGroup(rank, 2, lambda: ""), attention_layers(model.model), torch.device("cpu"),
                     place=lambda module, device: None, checkpoint=reader.checkpoint if slices else None,
                     quantized=model.quantized)
    return model.model, reader


@pytest.mark.parametrize("case", ["float_down_proj_and_head",
                                  pytest.param("gptq_tied_embeddings", marks=pytest.mark.slow)])
def test_a_quantized_checkpoints_float_tensors_read_as_slices(case, tmp_path):
    """The embedding and LM head (tied, or float beside int4 linears with a vocabulary
    of 511 that pads the head's last share) and a float row-split linear the config
    leaves unquantized: each rank's slices equal, tensor for tensor, its shard of the
    whole tensors."""
    directory = tmp_path / case
    if case == "gptq_tied_embeddings":
        _, config, quantize, _ = FORMATS[case]
        ckpt.write_quantized(build_tiny_model(tmp_path / "float", "qwen3", tie_word_embeddings=True), directory,
                             config, quantize)
    else:
        kept = "model.layers.1.mlp.down_proj"
        weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}
        config = ckpt.compressed_config("pack-quantized", weights, ignore=("lm_head", kept))
        ckpt.write_quantized(build_tiny_model(tmp_path / "float", "llama", vocab_size=511), directory, config,
                             ckpt.pack_quantized(32, True), modules=lambda names: [n for n in names if n != kept])
    for rank in (0, 1):
        expected, _ = rank_shard(directory, rank, slices=False)
        got, reader = rank_shard(directory, rank, slices=True)
        assert reader.checkpoint is not None and len(reader.checkpoint.sources) >= 2
        want, have = expected.state_dict(), got.state_dict()
        assert sorted(want) == sorted(have)
        for name, tensor in want.items():
            assert have[name].dtype == tensor.dtype and torch.equal(have[name], tensor), (case, rank, name)
        assert not any(parameter.is_meta for parameter in got.parameters())


@pytest.mark.slow
def test_experts_a_slice_would_cut_are_read_whole_and_refused(tmp_path):
    """Act-order int8 experts whose down groups mix the ranks' inputs: not read as slices
    (no share marked), and the split refuses them naming the expert's linear."""
    quantization_config, quantize = EXPERT_FORMATS["gptq_int8_act_order"]
    float_dir = build_tiny_model(tmp_path / "float", "qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=96, norm_topk_prob=True)
    ckpt.write_quantized(float_dir, tmp_path / "int8", quantization_config, quantize)
    model, weights = loaded(tmp_path / "int8", read_experts=False)
    group = RankGroup(0, 2, lambda: "")
    assert put_expert_shares(model, group, weights) == 0
    experts = model.get_submodule("model.layers.0.mlp.experts")
    assert isinstance(experts, QuantizedExperts) and not getattr(experts, RANK_SHARE, False)
    assert experts.down.in_features == 96  # read whole
    with pytest.raises(ShardingError, match=r"experts\.down\.0\.down_proj: its act-order \(g_idx\) groups mix"):
        split_quantized_experts(experts, "experts", group)


def test_asymmetric_int8_shares_carry_their_zero_points(tmp_path):
    """An asymmetric int8 checkpoint's linears split with their zero points: the two
    ranks' column shares stacked, and row shares side by side, dequantize to the whole
    linear (the slice-read shares equal these: SLICED above); the pre-flight verdict
    passes it for 2 ranks."""
    arch, config, quantize, _ = FORMATS["compressed_int8_asymmetric_channel"]
    directory = tmp_path / "asymmetric"
    ckpt.write_quantized(build_tiny_model(tmp_path / "float", arch), directory, config, quantize)
    whole, weights = loaded(directory)
    put_quantized_linears(whole, weights)
    wanted = {name: dequantized(layer) for name, layer in quantized_parts(whole).items()
              if isinstance(layer, QuantizedLinear)}
    assert len(wanted) == 14 and all(layer.zero is not None for _, layer in quantized_parts(whole).items()
                                     if isinstance(layer, QuantizedLinear))
    shares = [whole_split(directory, RankGroup(rank, 2, lambda: "")) for rank in (0, 1)]
    for name, weight in wanted.items():
        parts = [quantized_parts(shard)[name] for shard in shares]
        if isinstance(parts[0], RowParallelQuantized):
            inner = [part.linear for part in parts if isinstance(part, RowParallelQuantized)]
            assert torch.equal(torch.cat([dequantized(layer) for layer in inner], dim=1), weight), name
        else:
            columns = [part for part in parts if isinstance(part, QuantizedLinear)]
            assert all(part.zero is not None and part.zero.shape == (part.out_features, 1) for part in columns)
            assert torch.equal(torch.cat([dequantized(layer) for layer in columns], dim=0), weight), name
    check_tensor_parallel(transformers.AutoConfig.from_pretrained(directory), 2, quantization=None, task="generate")


@pytest.mark.parametrize("name", ["compressed_int8_asymmetric_groups", "compressed_w8a16_asymmetric_groups"])
def test_a_share_cutting_a_group_is_refused_in_preflight_and_at_load(name, tmp_path):
    """An intermediate size of 96 over 2 ranks gives down_proj's row shares 48 input
    columns, which cut a group of 32: the pre-flight verdict (config only) and the load
    (before any quantized linear is read) refuse it with one line naming the linear, the format
    and the share."""
    arch, config, quantize, _ = FORMATS[name]
    directory = tmp_path / name
    ckpt.write_quantized(build_tiny_model(tmp_path / "float", arch, intermediate_size=96), directory, config, quantize)
    refusal = (r"model\.layers\.0\.mlp\.down_proj: a rank's share \[0, 48\) of its 96 input columns does not fall on "
               r"the bounds of its scale groups of 32 \(compressed-tensors \(int8\) checkpoint; a share must hold "
               r"whole ones\); it is not split over 2 ranks$")
    with pytest.raises(ShardingError, match=refusal):
        tensor_parallel_verdict(transformers.AutoConfig.from_pretrained(directory), 2, quantization=None,
                                task="generate")
    model, weights = loaded(directory)
    with pytest.raises(ShardingError, match=refusal):
        shard_then_place(model, RankGroup(0, 2, lambda: ""), attention_layers(model), torch.device("cpu"),
                         quantized=weights)
    assert all(parameter.is_meta for key, parameter in model.named_parameters() if "down_proj" in key)
