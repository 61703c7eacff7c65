"""W8A8 linears (inputs quantized per token, INT8 or FP8) split by their input over
tensor-parallel ranks: each rank quantizes its columns with the whole row's scale (the
max over ranks of each rank's max|x|) into the whole layer's codes for them, over a real
gloo group of 2 and 3 ranks; a compressed-tensors INT8 W8A8 Llama on 2 gloo ranks gives
1 rank's and transformers' own greedy tokens, and a W8A8 Qwen3-MoE (experts included,
down's share quantizing each expert's input likewise) its own forward's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from shardline import LLM, SamplingParams
from shardline.engine.lora.layers import BatchedLoRALinear, LoRATokenGroups
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.parallel.experts import RowShareExperts, split_quantized_experts
from shardline.engine.parallel.group import RankGroup
from shardline.engine.parallel.layers import row_share
from shardline.engine.parallel.quantized import RowParallelQuantized, split_quantized
from shardline.engine.quantization.activations import (
    InputQuantization,
    fake_quantize_inputs,
    fake_quantize_with_scales,
    scales_from_absmax,
    token_scales,
)
from shardline.engine.quantization.experts import QuantizedExperts, SiluGatedHalves, stack_w8
from shardline.engine.quantization.linear import QuantizedLinear

from ..hf_reference import hf_greedy
from ..quantization import checkpoints as ckpt
from ..quantization.moe_checkpoints import tiny_qwen3_moe
from ..quantization.test_formats import FORMATS, MAX_NEW_TOKENS, PROMPTS, clear_prompts
from ..quantization.test_w8a8_experts import CONFIG as MOE_CONFIG
from ..quantization.test_w8a8_experts import MOE_MARGIN, w8a8_reference
from ..quantization.test_w8a8_experts import NEW_TOKENS as MOE_TOKENS
from ..quantization.test_w8a8_experts import PROMPTS as MOE_PROMPTS
from .test_quantized import OPTIONS

IN_FEATURES, OUT_FEATURES, TOKENS = 96, 24, 7


def w8a8_layer(kind: InputQuantization, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> QuantizedLinear:
    """A W8A8 layer (int8 codes for int8 inputs, FP8 for fp8), by default [24, 96] with a bias."""
    if weight is None:
        generator = torch.Generator().manual_seed(5)
        weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator)
        bias = torch.randn(OUT_FEATURES, generator=generator)
    quantize = ckpt.int8_per_channel if kind == "int8" else ckpt.fp8_per_channel
    tensors, _ = quantize("layer", weight)
    layer = QuantizedLinear.w8(tensors["weight"], tensors["weight_scale"].float(), None, bias)
    layer.input_quantization = kind
    return layer


def inputs() -> torch.Tensor:
    """Tokens whose largest |x| lies in different columns (so in different ranks' shares),
    one of them all zeros (the epsilon scale)."""
    x = torch.randn(TOKENS, IN_FEATURES, generator=torch.Generator().manual_seed(6))
    for token in range(TOKENS - 1):
        x[token, (token * 17) % IN_FEATURES] = 6.0 + token
    x[-1] = 0.0
    return x


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("size", [2, 3])
def test_the_max_over_shares_gives_the_whole_rows_codes(kind, size):
    x = inputs()
    share = IN_FEATURES // size
    columns = [x[:, rank * share:(rank + 1) * share] for rank in range(size)]
    whole_max = torch.stack([part.abs().amax(dim=-1, keepdim=True) for part in columns]).amax(dim=0)
    scales = scales_from_absmax(whole_max, kind)
    assert torch.equal(scales, token_scales(x, kind))
    quantized = torch.cat([fake_quantize_with_scales(part, scales, kind) for part in columns], dim=-1)
    assert torch.equal(quantized, fake_quantize_inputs(x, kind))
    # A share's own scale would give other codes: the whole row's scale is needed.
    assert not torch.equal(fake_quantize_inputs(columns[0], kind), quantized[:, :share])


def _rank_checks(rank: int, size: int, store_path: str, kind: InputQuantization) -> None:
    store = dist.FileStore(store_path, size)  # pyright: ignore[reportPrivateImportUsage] - public, not in __all__
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    try:
        layer, x = w8a8_layer(kind), inputs()
        with torch.no_grad():
            layer.use_reference = True
            expected = layer(x)
            layer.use_reference = False
            part = split_quantized(layer, "o_proj", None, RankGroup(rank, size, lambda: "test ranks"))
            assert isinstance(part, RowParallelQuantized) and part.input_quantization == kind
            share = IN_FEATURES // size
            columns = slice(rank * share, (rank + 1) * share)
            codes = part.quantize_share(x[:, columns])
            assert torch.equal(codes, fake_quantize_inputs(x, kind)[:, columns])
            out = part(x[:, columns])
            # The inner share quantizes its own input (a wrapper of it passes x unquantized).
            assert part.bias is not None
            inner = part.group.all_reduce(part.linear(x[:, columns])) + part.bias
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(inner, expected, rtol=1e-5, atol=1e-5)
        _check_lora_on_share(layer, x, expected, RankGroup(rank, size, lambda: "test ranks"))
    finally:
        dist.destroy_process_group()


def _check_lora_on_share(layer: QuantizedLinear, x: torch.Tensor, expected: torch.Tensor, group: RankGroup) -> None:
    """A LoRA layer around the row share's inner linear: its base quantizes the input with
    the whole row's scale, its adapter reads the input unquantized (as on one rank)."""
    part = row_share(layer, "o_proj", group)
    assert isinstance(part, RowParallelQuantized)
    groups = LoRATokenGroups(num_tokens=TOKENS, groups=[(0, None)])
    wrapped = BatchedLoRALinear(part.linear, 1, 4, groups, torch.device("cpu"), torch.float32)
    part.register_module("linear", wrapped)
    generator = torch.Generator().manual_seed(11)
    lora_a, lora_b = torch.randn(4, IN_FEATURES, generator=generator), torch.randn(OUT_FEATURES, 4, generator=generator)
    wrapped.set_slot(0, lora_a, lora_b)
    share = IN_FEATURES // group.size
    with torch.no_grad():
        out = part(x[:, group.rank * share:(group.rank + 1) * share])
    torch.testing.assert_close(out, expected + (x @ lora_a.T) @ lora_b.T, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("size", [2, 3])
def test_row_shares_quantize_with_the_whole_rows_scale_over_gloo(kind, size, tmp_path):
    """Over a real gloo group: each rank's quantized columns are the whole layer's, and
    the summed output is the whole layer's W8A8 product (float32 sums in another order)."""
    mp.spawn(_rank_checks, args=(size, str(tmp_path / "store"), kind), nprocs=size,  # pyright: ignore[reportPrivateImportUsage]
             join=True)


def w8a8_experts(kind: InputQuantization) -> QuantizedExperts:
    """3 W8A8 experts (hidden 32, intermediate 48): gate and up, then down, stacked."""
    generator = torch.Generator().manual_seed(7)

    def linears(rows: int, cols: int) -> list[QuantizedLinear]:
        return [w8a8_layer(kind, torch.randn(rows, cols, generator=generator), None) for _ in range(3)]

    gate_up = stack_w8({"gate_proj": linears(48, 32), "up_proj": linears(48, 32)})
    return QuantizedExperts(gate_up, stack_w8({"down_proj": linears(32, 48)}), SiluGatedHalves(nn.SiLU()))


def _experts_rank_checks(rank: int, size: int, store_path: str, kind: InputQuantization) -> None:
    store = dist.FileStore(store_path, size)  # pyright: ignore[reportPrivateImportUsage] - public, not in __all__
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    try:
        experts = w8a8_experts(kind)
        group = RankGroup(rank, size, lambda: "test ranks")
        part = split_quantized_experts(experts, "mlp.experts", group)
        assert isinstance(part.inner, QuantizedExperts) and isinstance(part.inner.down, RowShareExperts)
        share = 48 // size
        columns = slice(rank * share, (rank + 1) * share)
        x = torch.randn(TOKENS, 48, generator=torch.Generator().manual_seed(8))
        for token in range(TOKENS):
            x[token, (token * 13) % 48] = 8.0 + token  # the row's max in one rank's columns
        hidden = torch.randn(TOKENS, 32, generator=torch.Generator().manual_seed(9))
        top_k_index = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1], [0, 1]])
        top_k_weights = torch.rand(TOKENS, 2, generator=torch.Generator().manual_seed(10))
        with torch.no_grad():
            for expert in range(3):
                summed = group.all_reduce(part.inner.down.matmul(expert, x[:, columns]))
                torch.testing.assert_close(summed, experts.down.matmul(expert, x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(part(hidden, top_k_index, top_k_weights),
                                       experts(hidden, top_k_index, top_k_weights), rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("size", [2, 3])
def test_expert_down_shares_quantize_with_the_whole_rows_scale_over_gloo(kind, size, tmp_path):
    """Over a real gloo group: each expert's down product summed over ranks is the whole
    expert's (inputs whose max lies in one rank's columns, so a rank's own scale would
    give other codes), and the experts' summed output is the whole module's."""
    mp.spawn(_experts_rank_checks, args=(size, str(tmp_path / "store"), kind),  # pyright: ignore[reportPrivateImportUsage]
             nprocs=size, join=True)


def test_compressed_int8_w8a8_llama_on_two_ranks(tmp_path: Path):
    """2 ranks and 1 give transformers' own tokens for the checkpoint (prompts without
    near-ties); o_proj and down_proj run as row shares quantizing their inputs."""
    arch, config, quantize, _ = FORMATS["compressed_int8_w8a8_channel"]
    float_dir = build_tiny_model(tmp_path / "float", arch)
    ckpt.write_quantized(float_dir, tmp_path / "w8a8", config, quantize)
    reference = ckpt.transformers_own_model(tmp_path / "w8a8")
    prompts = clear_prompts(reference, PROMPTS)
    assert len(prompts) >= 3
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    assert len({tuple(tokens) for tokens in expected}) > 1
    for size in (1, 2):
        llm = LLM(str(tmp_path / "w8a8"), tensor_parallel_size=size, **OPTIONS)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0), use_tqdm=False)
            assert [list(output.outputs[0].token_ids) for output in outputs] == expected, size
            if size == 2:
                shares = [module for module in ckpt.engine_model(llm).modules()
                          if isinstance(module, RowParallelQuantized)]
                assert shares and {share.input_quantization for share in shares} == {"int8"}
        finally:
            llm.close()



@pytest.mark.slow
def test_compressed_int8_w8a8_qwen3_moe_on_two_ranks(tmp_path: Path):
    """The W8A8 Qwen3-MoE checkpoint (experts included) on 2 ranks and 1 gives its own
    forward's tokens (prompts without near-ties); down's shares quantize each expert's
    input with the whole row's scale."""
    float_dir = tiny_qwen3_moe(tmp_path / "float")
    dequantized = ckpt.write_quantized(float_dir, tmp_path / "w8a8", MOE_CONFIG, ckpt.int8_per_channel)
    reference = w8a8_reference(float_dir, dequantized)
    expected = {tuple(prompt): hf_greedy(reference, prompt, MOE_TOKENS) for prompt in MOE_PROMPTS}
    assert len(set(map(tuple, expected.values()))) > 1
    clear = []
    for prompt in MOE_PROMPTS:
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + expected[tuple(prompt)]])).logits[0, len(prompt) - 1: -1]
        top = logits.topk(2).values
        if bool(((top[:, 0] - top[:, 1]) > MOE_MARGIN).all()):
            clear.append(prompt)
    assert len(clear) >= 3
    for size in (1, 2):
        llm = LLM(str(tmp_path / "w8a8"), tensor_parallel_size=size, **OPTIONS)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in clear],
                                   SamplingParams(max_tokens=MOE_TOKENS, temperature=0, ignore_eos=True),
                                   use_tqdm=False)
            assert [list(output.outputs[0].token_ids) for output in outputs] == \
                [expected[tuple(p)] for p in clear], size
            if size == 2:
                downs = [module.down for module in ckpt.engine_model(llm).modules()
                         if isinstance(module, QuantizedExperts)]
                assert len(downs) == 2 and all(isinstance(down, RowShareExperts) for down in downs)
        finally:
            llm.close()
