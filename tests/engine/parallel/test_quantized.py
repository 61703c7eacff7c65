"""Quantized linears split over ranks with their scales: each rank's share dequantizes to
the float split's rows or columns, a share that would cut a block or mix act-order groups
is refused naming the layer, and quantized checkpoints (FP8 per channel and in 128x128
blocks, GPTQ int4) on 2 gloo ranks give 1 rank's and the dequantized transformers
model's greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.parallel.group import RankGroup, ShardingError
from shardline.engine.parallel.quantized import RowParallelQuantized, split_quantized
from shardline.engine.quantization.linear import QuantizedLinear

from ..hf_reference import hf_greedy, random_prompts
from ..quantization import checkpoints as ckpt

MAX_TOKENS = 10
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128)


def group_of(rank: int, size: int = 2) -> RankGroup:
    return RankGroup(rank, size, lambda: "no collective runs in these tests")


def dequantized(layer: torch.nn.Module) -> torch.Tensor:
    """A share's float32 weight in input-column order (act-order undone)."""
    inner = layer.linear if isinstance(layer, RowParallelQuantized) else layer
    assert isinstance(inner, QuantizedLinear)
    weight = inner.dequantized_rows(0, inner.out_features)
    if inner.input_perm is None:
        return weight
    ordered = torch.empty_like(weight)
    ordered[:, inner.input_perm] = weight
    return ordered


def fp8_layer(weight: torch.Tensor, block: tuple[int, int] | None) -> QuantizedLinear:
    quantize = ckpt.fp8_blocks(block) if block else ckpt.fp8_per_channel
    tensors, _ = quantize("layer", weight)
    scale = next(tensor for name, tensor in tensors.items() if name.startswith("weight_scale"))
    return QuantizedLinear.w8(tensors["weight"], scale.float(), block, torch.randn(weight.shape[0]))


def int4_layer(weight: torch.Tensor, group_size: int, act_order: bool = False) -> QuantizedLinear:
    cols = weight.shape[1]
    column_group = torch.arange(cols) // group_size
    if act_order:
        column_group = column_group[torch.randperm(cols, generator=torch.Generator().manual_seed(0))]
    codes, scales, zeros = ckpt.int4_groups(weight, group_size, symmetric=False, column_group=column_group)
    perm = torch.sort(column_group, stable=True).indices if act_order else None
    stored = codes if perm is None else codes[:, perm]
    return QuantizedLinear.w4(_pack(stored), scales.float(), zeros.float(), group_size, perm,
                              torch.randn(weight.shape[0]))


def _pack(codes: torch.Tensor) -> torch.Tensor:
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


@pytest.mark.parametrize("make", [lambda w: fp8_layer(w, None), lambda w: fp8_layer(w, (32, 32)),
                                  lambda w: int4_layer(w, 32)], ids=["fp8_channel", "fp8_blocks", "int4_groups"])
def test_shares_dequantize_to_the_float_split(make):
    weight = torch.randn(128, 128, generator=torch.Generator().manual_seed(1))
    layer = make(weight)
    whole = dequantized(layer)
    for rank in range(2):
        group = group_of(rank)
        rows = split_quantized(layer, "q_proj", slice(rank * 64, (rank + 1) * 64), group)
        assert torch.equal(dequantized(rows), whole[rank * 64:(rank + 1) * 64])
        assert isinstance(rows, QuantizedLinear) and layer.bias is not None and rows.bias is not None
        assert torch.equal(rows.bias, layer.bias[rank * 64:(rank + 1) * 64])
        packed = torch.cat([torch.arange(rank * 32, rank * 32 + 32), torch.arange(64 + rank * 32, 96 + rank * 32)])
        assert torch.equal(dequantized(split_quantized(layer, "gate_up_proj", packed, group)), whole[packed])
        columns = split_quantized(layer, "o_proj", None, group)
        assert isinstance(columns, RowParallelQuantized) and columns.linear.bias is None
        assert columns.bias is layer.bias  # added once, after the sum over ranks
        assert torch.equal(dequantized(columns), whole[:, rank * 64:(rank + 1) * 64])


@pytest.mark.parametrize("inputs", ["int8", "fp8"])
def test_w8a8_shares_keep_their_input_quantization(inputs):
    """A W8A8 layer quantizes each token's whole input row with one scale: a column
    share keeps that (and the kernel settings); a row share quantizes its columns itself
    with the whole row's scale (test_tp_w8a8.py), its inner share multiplying them as given."""
    layer = fp8_layer(torch.randn(64, 128, generator=torch.Generator().manual_seed(4)), None)
    layer.input_quantization, layer.int8_kernel, layer.cpu_kernels = inputs, False, False
    rows = split_quantized(layer, "q_proj", slice(32, 64), group_of(1))
    assert isinstance(rows, QuantizedLinear)
    assert (rows.input_quantization, rows.int8_kernel, rows.cpu_kernels) == (inputs, False, False)
    columns = split_quantized(layer, "o_proj", None, group_of(0))
    assert isinstance(columns, RowParallelQuantized) and columns.input_quantization == inputs
    assert (columns.linear.input_quantization, columns.linear.activations) == ("none", "none")
    assert layer.input_quantization == inputs


def test_one_group_per_row_splits_row_wise():
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(2))
    layer = int4_layer(weight, 128)
    for rank in range(2):
        columns = split_quantized(layer, "down_proj", None, group_of(rank))
        assert torch.equal(dequantized(columns), dequantized(layer)[:, rank * 64:(rank + 1) * 64])


def test_act_order_splits_column_wise_and_is_refused_row_wise():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    layer = int4_layer(weight, 32, act_order=True)
    rows = split_quantized(layer, "q_proj", slice(32, 64), group_of(1))
    assert torch.equal(dequantized(rows), dequantized(layer)[32:64])
    with pytest.raises(ShardingError, match="o_proj: its act-order"):
        split_quantized(layer, "o_proj", None, group_of(0))


def test_a_share_cutting_a_block_is_refused():
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    layer = fp8_layer(weight, (128, 128))  # one partial block holds the whole weight
    with pytest.raises(ShardingError, match=r"k_proj: a rank's share \[32, 64\) of its 64 output rows .* blocks of "
                                            "128"):
        split_quantized(layer, "k_proj", slice(32, 64), group_of(1))
    with pytest.raises(ShardingError, match="o_proj: .* input columns .* blocks of 128"):
        split_quantized(layer, "o_proj", None, group_of(0))
    with pytest.raises(ShardingError, match="down_proj: .* blocks of 32"):
        split_quantized(int4_layer(torch.randn(8, 96), 32), "down_proj", None, group_of(0))


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def check_two_ranks(float_dir, quantized_dir, dequantized_weights) -> None:
    """2 ranks and 1 give the dequantized transformers model's greedy tokens, which
    depend on the prompt; the ranks hold quantized shares."""
    def holds_quantized_shares(model: nn.Module) -> bool:
        return {QuantizedLinear, RowParallelQuantized} <= {type(module) for module in model.modules()}

    two_ranks_match(ckpt.reference_model(float_dir, dequantized_weights), quantized_dir, holds_quantized_shares,
                    num_short=4)


def two_ranks_match(reference: transformers.PreTrainedModel, quantized_dir: Path,
                    holds_shares: Callable[[nn.Module], bool], num_short: int) -> None:
    """The quantized checkpoint on 1 rank and on 2 gives ``reference``'s greedy tokens
    (which depend on the prompt: 3 prompts sharing a prefix, ``num_short`` short ones),
    and the 2 ranks' model passes ``holds_shares``."""
    vocab_size = reference.config.vocab_size
    prompts = random_prompts(3, (9, 12), vocab_size, seed=1, shared_prefix=32) + \
        random_prompts(num_short, (4, 12), vocab_size, seed=2)
    expected = [hf_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    assert len({tuple(tokens) for tokens in expected}) > 1
    one_rank = LLM(str(quantized_dir), **OPTIONS)
    try:
        assert generate(one_rank, prompts) == expected
    finally:
        one_rank.close()
    two_ranks = LLM(str(quantized_dir), tensor_parallel_size=2, **OPTIONS)
    try:
        assert generate(two_ranks, prompts) == expected
        assert holds_shares(ckpt.engine_model(two_ranks))
    finally:
        two_ranks.close()


def test_fp8_per_channel_on_two_ranks(tmp_path):
    float_dir = build_tiny_model(tmp_path / "float", "llama")
    config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    weights = ckpt.write_quantized(float_dir, tmp_path / "fp8", config, ckpt.fp8_per_channel)
    check_two_ranks(float_dir, tmp_path / "fp8", weights)


@pytest.mark.slow
def test_fp8_128_blocks_on_two_ranks(tmp_path):
    """Sizes whose every rank's share falls on 128x128 block boundaries (256 query and
    key-value rows, 512 intermediate rows, 256 and 512 input columns)."""
    float_dir = build_tiny_model(tmp_path / "float", "llama", hidden_size=256, intermediate_size=512,
                                 num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    weights = ckpt.write_quantized(float_dir, tmp_path / "fp8", config, ckpt.fp8_blocks((128, 128)))
    check_two_ranks(float_dir, tmp_path / "fp8", weights)


def test_gptq_int4_on_two_ranks(tmp_path):
    float_dir = build_tiny_model(tmp_path / "float", "llama")
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
              "checkpoint_format": "gptq"}
    weights = ckpt.write_quantized(float_dir, tmp_path / "gptq", config, ckpt.gptq(32, False))
    check_two_ranks(float_dir, tmp_path / "gptq", weights)


@pytest.mark.slow
def test_fp8_blocks_the_ranks_cannot_split_are_refused(tmp_path):
    float_dir = build_tiny_model(tmp_path / "float", "llama")
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    ckpt.write_quantized(float_dir, tmp_path / "fp8", config, ckpt.fp8_blocks((128, 128)))
    with pytest.raises(ShardingError, match=r"model\.layers\.0\.self_attn\.q_proj: .* blocks of 128"):
        LLM(str(tmp_path / "fp8"), tensor_parallel_size=2, **OPTIONS)


@pytest.mark.slow
def test_gptq_act_order_split_by_input_is_refused_at_load(tmp_path):
    float_dir = build_tiny_model(tmp_path / "float", "llama")
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
              "checkpoint_format": "gptq"}
    ckpt.write_quantized(float_dir, tmp_path / "gptq", config, ckpt.gptq(32, False, act_order=True))
    with pytest.raises(ShardingError, match=r"model\.layers\.0\.self_attn\.o_proj: its act-order \(g_idx\) groups"):
        LLM(str(tmp_path / "gptq"), tensor_parallel_size=2, **OPTIONS)
