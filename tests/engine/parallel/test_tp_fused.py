"""Fused query-key-value projections split by heads over 2 gloo ranks give one rank's
(and transformers') greedy tokens: phi3 ([q | k | v] rows with grouped key-value
heads, its fused gate_up_proj), GPT-NeoX (rows per head), GPT-2 (a Conv1D c_attn,
weights stored transposed), BLOOM (ALiBi cut to each rank's heads), falcon's three
layouts, GPT-BigCode's multi-query one, MPT, Zamba2's shared MLP; a LoRA adapter and
quantized checkpoints on fused projections; and the rows each rank keeps, per layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from torch import nn

from shardline import LLM, LoRARequest
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.parallel.fused import BLOCKS, GROUPED, PER_HEAD, FusedLayout, fused_rows
from shardline.engine.parallel.group import RankGroup, ShardingError
from shardline.engine.parallel.layers import RowParallelLinear
from shardline.engine.quantization.linear import QuantizedLinear

from ..coverage_configs import tiny_overrides
from ..hf_reference import hf_greedy, load_hf_model, random_prompts
from .test_tensor_parallel import MAX_TOKENS, OPTIONS, generate


def rows(kind: str, heads: int, kv: int, rank: int, size: int) -> list[int]:
    """The rows kept, in heads of size 1 (a row per head)."""
    return fused_rows(FusedLayout(kind, heads, kv, 1), "qkv", rank, size).tolist()


def test_each_rank_keeps_its_heads_rows_per_layout():
    # [q0..q3 | k0 k1 | v0 v1]: rank 1 keeps q2 q3, k1, v1
    assert rows(BLOCKS, 4, 2, 1, 2) == [2, 3, 5, 7]
    # one key-value head (multi-query) replicated: rank 1 keeps q2 q3 and the k and v
    assert rows(BLOCKS, 4, 1, 1, 2) == [2, 3, 4, 5]
    # [h0: q k v | h1: q k v | ...]: rank 1 keeps heads 2 and 3, whole
    assert rows(PER_HEAD, 4, 4, 1, 2) == list(range(6, 12))
    # [g0: q0 q1 k v | g1: q2 q3 k v]: rank 1 keeps group 1
    assert rows(GROUPED, 4, 2, 1, 2) == [4, 5, 6, 7]
    # one group over 2 ranks: rank 1 keeps q2 q3 and the group's k and v
    assert rows(GROUPED, 4, 1, 1, 2) == [2, 3, 4, 5]
    # 8 heads in 2 groups over 4 ranks: rank 3 keeps q6 q7 of group 1 and its k and v
    assert rows(GROUPED, 8, 2, 3, 4) == [8, 9, 10, 11]
    # CodeGen's 4 blocks of heads: whole blocks per rank, so 8 ranks are refused
    with pytest.raises(ShardingError, match="qkv: its 4 model-parallel blocks of heads do not split over 8 ranks"):
        fused_rows(FusedLayout(PER_HEAD, 8, 8, 1, blocks=4), "qkv", 0, 8)


def two_ranks_agree(tmp_path, arch: str, **overrides) -> None:
    """2 ranks give 1 rank's greedy tokens and transformers' (float32) on three prompts,
    one cut into chunks: the fused projections are split (a row-split output beside)."""
    model_dir = str(build_tiny_model(tmp_path, arch, **overrides))
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    prompts = random_prompts(3, (4, 24), reference.config.get_text_config().vocab_size, seed=3)
    expected = [hf_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    assert len({tuple(tokens) for tokens in expected}) > 1  # the tokens depend on the prompt
    for size in (1, 2):
        llm = LLM(model_dir, tensor_parallel_size=size, **OPTIONS)
        try:
            assert generate(llm, prompts) == expected, f"{size} rank(s)"
            engine: Any = llm.llm_engine
            if size == 2:
                assert RowParallelLinear in {type(module) for module in engine.runner.model.modules()}
        finally:
            llm.close()


def test_phi3_on_two_ranks(tmp_path):
    """qkv_proj [q | k | v] with 4 query and 2 key-value heads; gate_up_proj [gate | up]."""
    two_ranks_agree(tmp_path, "phi3", num_attention_heads=4, num_key_value_heads=2)


def test_gpt_neox_on_two_ranks(tmp_path):
    two_ranks_agree(tmp_path, "gpt_neox")


def test_gpt2_on_two_ranks(tmp_path):
    """GPT-2's Conv1D c_attn, c_proj, c_fc: each rank's rows read as a linear's."""
    two_ranks_agree(tmp_path, "gpt2")


@pytest.mark.slow
def test_bloom_with_alibi_on_two_ranks(tmp_path):
    """BLOOM: rows per head, and the ALiBi its model builds for every head cut to each
    rank's heads (its adapter's slopes too)."""
    two_ranks_agree(tmp_path, "bloom")


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    dict(multi_query=True, new_decoder_architecture=False),  # [q heads | k | v]
    dict(multi_query=False, new_decoder_architecture=False),  # [h: q, k, v]
    dict(new_decoder_architecture=True, num_kv_heads=2),  # [g: q heads, k, v]
    dict(new_decoder_architecture=True, num_kv_heads=1),  # one group over both ranks
], ids=["multi_query", "per_head", "grouped", "one_group"])
def test_falcon_layouts_on_two_ranks(tmp_path, overrides):
    two_ranks_agree(tmp_path, "falcon", **overrides)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "overrides"), [
    ("gpt_bigcode", {}), ("persimmon", {}), ("openai-gpt", {}), ("gpt_neox_japanese", {}), ("mpt", {}),
    ("codegen", dict(rotary_dim=8)),  # its 4 blocks of [q | v | k] heads: 2 whole blocks per rank
], ids=["gpt_bigcode", "persimmon", "openai-gpt", "gpt_neox_japanese", "mpt", "codegen"])
def test_other_fused_models_on_two_ranks(tmp_path, arch, overrides):
    two_ranks_agree(tmp_path, arch, **overrides)


def test_a_conv1d_share_is_the_linear_of_its_product():
    from transformers.pytorch_utils import Conv1D

    from shardline.engine.parallel.fused import as_linear

    conv = Conv1D(6, 4)
    nn.init.normal_(conv.weight)
    nn.init.normal_(conv.bias)
    x = torch.randn(3, 4)
    torch.testing.assert_close(as_linear(conv)(x), conv(x))


@pytest.mark.slow
def test_a_lora_adapter_on_phi3_fused_projections_on_two_ranks(tmp_path):
    """An adapter on phi3's qkv_proj, gate_up_proj, o_proj and down_proj: B keeps the
    rank's fused rows (its query and key-value heads', its gate and up rows), A the row
    shares' columns; 2 ranks give transformers' tokens with the adapter merged (peft)."""
    from ..lora.test_lora import make_adapter, merged_model
    from .test_tp_lora import LORA_OPTIONS
    from .test_tp_lora import generate as generate_with_loras

    model_dir = str(build_tiny_model(tmp_path / "model", "phi3", num_attention_heads=4, num_key_value_heads=2))
    path = make_adapter(model_dir, tmp_path / "lora", seed=1, r=8, lora_alpha=16,
                        target_modules=["qkv_proj", "gate_up_proj", "o_proj", "down_proj"])
    reference = merged_model(model_dir, path)
    prompts = random_prompts(3, (4, 24), 512, seed=3)
    expected = [hf_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    base = load_hf_model(model_dir)
    assert expected != [hf_greedy(base, prompt, MAX_TOKENS) for prompt in prompts]  # the adapter changes tokens
    request = LoRARequest("fused", 1, path)
    llm = LLM(model_dir, tensor_parallel_size=2, **LORA_OPTIONS)
    try:
        assert generate_with_loras(llm, prompts, [request] * len(prompts)) == expected
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["zamba2", "minimax_m3_vl_text"])
def test_fused_gate_up_mlps_on_two_ranks(tmp_path, arch):
    """Zamba2's shared block (its MLP's fused gate_up_proj [gate | up] and the low-rank
    adapters added to it) and MiniMax-M3's shared experts keep each rank's gate rows and
    the matching up rows."""
    two_ranks_agree(tmp_path, arch, **tiny_overrides(arch))


@pytest.mark.parametrize("fmt", ["fp8_channel_with_biases", "gptq_v2"])
def test_a_quantized_fused_checkpoint_splits_with_its_scales(fmt, tmp_path):
    """phi3 quantized (per-channel FP8; GPTQ's groups along the input): each rank's
    qkv_proj and gate_up_proj rows read as slices with their scales dequantize to the
    rows split from the whole quantized linears."""
    from shardline.engine.parallel.placement import shard_then_place
    from shardline.engine.parallel.quantized_slices import quantized_share_plan

    from ..quantization import checkpoints as ckpt
    from ..quantization.test_formats import FORMATS
    from .test_tp_loading_quantized import attention_layers, dequantized, loaded, whole_split

    _, config, quantize, _ = FORMATS[fmt]
    float_dir = build_tiny_model(tmp_path / "float", "phi3", num_attention_heads=4, num_key_value_heads=2)
    directory = tmp_path / fmt
    ckpt.write_quantized(float_dir, directory, config, quantize)
    for rank in (0, 1):
        group = RankGroup(rank, 2, lambda: "")
        whole = whole_split(directory, group)
        sliced, weights = loaded(directory)
        assert {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"} <= set(
            quantized_share_plan(sliced, group, weights))
        shard_then_place(sliced, group, attention_layers(sliced), torch.device("cpu"), quantized=weights)
        # 4 query heads of 16 and 2 key-value heads: a rank's 2 query heads' rows, its key's and its value's
        assert sliced.get_submodule("model.layers.0.self_attn.qkv_proj").out_features == 2 * 16 + 16 + 16
        for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"):
            got, expected = sliced.get_submodule(name), whole.get_submodule(name)
            assert isinstance(got, QuantizedLinear) and isinstance(expected, QuantizedLinear)
            assert torch.equal(dequantized(got), dequantized(expected)), name


@pytest.mark.parametrize(("arch", "overrides"), [
    ("phi3", dict(num_attention_heads=4, num_key_value_heads=2)),
    ("gpt2", {}),  # Conv1D weights stored [in, out]: slices read transposed
    ("falcon", dict(new_decoder_architecture=True, num_kv_heads=1)),  # FalconLinear, one group over both ranks
    ("gpt_bigcode", {}),
    ("bloom", {}),
], ids=["phi3", "gpt2", "falcon_one_group", "gpt_bigcode", "bloom"])
def test_fused_slices_equal_the_whole_models_split(arch, overrides, tmp_path):
    """Each rank reads its fused projections' rows (and its output projections' and
    MLPs' shares) as slices of the checkpoint, equal tensor for tensor to the shard cut
    from the whole model."""
    from .test_tp_loading import shard

    model_dir = str(build_tiny_model(tmp_path, arch, **overrides))
    for rank in (0, 1):
        expected, _ = shard(model_dir, rank, slices=False)
        got, reader = shard(model_dir, rank, slices=True)
        assert reader.checkpoint is not None, "read whole: the slice reader declined the model"
        want, have = expected.state_dict(), got.state_dict()
        assert sorted(want) == sorted(have)
        for name, tensor in want.items():
            assert torch.equal(have[name], tensor), (arch, rank, name)
