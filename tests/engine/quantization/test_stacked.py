"""Stacked quantized groups (engine/quantization/stacked.py): a group of quantized
linears on one input (q, k, v; gate, up) run as one call gives each part's own output,
bit for bit where the kernel computes each output column alone (the decode kernels,
bfloat16's dot-product tiles), within float32 rounding in the prefill panels (torch's or
oneDNN's matmul, which may order a column's sums by the output's width: MKL's AVX2
sgemm does) and the torch path;
the parts become views of the stacked tensors (no second copy); parts that disagree
stay separate; and in an engine every Llama-family layer runs its groups stacked."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from shardline import LLM
from shardline.engine.kernels.cpu_fused import fused_kernels_available
from shardline.engine.kernels.cpu_quant import DECODE_MAX_ROWS, TILE_MAX_ROWS, bfloat16_tiles_ready, cpu_quant_available
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.quantization.formats import pack_int4
from shardline.engine.quantization.linear import QuantizedLinear
from shardline.engine.quantization.stacked import StackedGatedMLP, stack_quantized, stack_refusal

from . import checkpoints as ckpt

IN_FEATURES = 128
SIZES = (64, 32, 48)  # a query, key and value of unequal widths; 48 is three blocks of 16
Part = Callable[[int, torch.Generator], QuantizedLinear]


def _w8(dtype: torch.dtype, scale_kind: str, block: tuple[int, int] | None = None,
        input_quantization: str = "none", zero: bool = False) -> Part:
    def build(rows: int, generator: torch.Generator) -> QuantizedLinear:
        weight = (torch.randn(rows, IN_FEATURES, generator=generator) * 40).clamp(-127, 127).to(dtype)
        shapes = {"tensor": (1, 1), "channel": (rows, 1),
                  "blocks": (-(-rows // block[0]), -(-IN_FEATURES // block[1])) if block else (0, 0)}
        scale = torch.rand(*shapes[scale_kind], generator=generator) / 50 + 1e-3
        zeros = torch.randint(-100, 100, scale.shape, generator=generator).float() if zero else None
        layer = QuantizedLinear.w8(weight, scale, block, torch.randn(rows, generator=generator), zero=zeros)
        layer.input_quantization = "int8" if input_quantization == "int8" else "none"
        return layer
    return build


def _w4(group_size: int, zeros: bool, perm_seed: int | None = None) -> Part:
    def build(rows: int, generator: torch.Generator) -> QuantizedLinear:
        groups = IN_FEATURES // group_size
        perm = None if perm_seed is None else torch.randperm(IN_FEATURES, generator=torch.Generator().manual_seed(
            perm_seed))
        return QuantizedLinear.w4(
            pack_int4(torch.randint(0, 16, (rows, IN_FEATURES), generator=generator)),
            torch.rand(rows, groups, generator=generator) / 20 + 1e-3,
            torch.randint(0, 16, (rows, groups), generator=generator).float() if zeros else None, group_size, perm)
    return build


CASES: dict[str, Part] = {
    "int8_per_tensor": _w8(torch.int8, "tensor"),
    "fp8_per_channel": _w8(torch.float8_e4m3fn, "channel"),
    "fp8_blocks": _w8(torch.float8_e4m3fn, "blocks", (16, 32)),
    "int8_gptq_8bit_groups": _w8(torch.int8, "blocks", (1, 32)),
    "w8a8_int8": _w8(torch.int8, "channel", input_quantization="int8"),
    "int8_asymmetric_tensor": _w8(torch.int8, "tensor", zero=True),
    "int8_asymmetric_channel_w8a8": _w8(torch.int8, "channel", input_quantization="int8", zero=True),
    "int8_asymmetric_groups": _w8(torch.int8, "blocks", (1, 32), zero=True),
    "int4_symmetric": _w4(32, zeros=False),
    "int4_zeros": _w4(64, zeros=True),
    "int4_act_order_same_perm": _w4(32, zeros=True, perm_seed=5),
}


def _parts(build: Part, seed: int = 0) -> list[QuantizedLinear]:
    generator = torch.Generator().manual_seed(seed)
    return [build(rows, generator) for rows in SIZES]


def _columns_alone(rows: int, dtype: torch.dtype) -> bool:
    """Whether the C kernels compute each output column of ``rows`` rows of x alone here:
    the decode kernels, and bfloat16 x's dot-product tiles where they are built; more
    rows go through the prefill panels."""
    return rows <= DECODE_MAX_ROWS or (dtype == torch.bfloat16 and rows <= TILE_MAX_ROWS and bfloat16_tiles_ready())


def _x(rows: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)


@pytest.mark.skipif(not cpu_quant_available(), reason="the quantized C kernels do not build here")
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_stacked_group_gives_each_parts_output(name, dtype):
    parts = _parts(CASES[name])
    separate = copy.deepcopy(parts)
    stacked = stack_quantized(parts)
    assert stacked.out_features == sum(SIZES)
    for rows in (1, 4, 7, 16, 300):  # the decode kernel, the blocked one (9-64 rows), prefill panels
        x = _x(rows, dtype)
        expected = [part(x) for part in separate]
        outputs = stacked(x).split(list(SIZES), dim=-1)
        for output, own, alone in zip(outputs, expected, [part(x) for part in parts], strict=True):
            if _columns_alone(rows, dtype) and stacked.zero is None:  # bit for bit
                assert torch.equal(output, own), (rows, (output.float() - own.float()).abs().max())
            else:
                torch.testing.assert_close(output, own, rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-4)
            assert torch.equal(alone, own)  # a part still runs alone, on its views
    assert not torch.equal(stacked(_x(1, dtype)), stacked(_x(2, dtype))[:1])  # the output depends on x


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_torch_path_of_a_stacked_group_matches_the_parts(name):
    parts = _parts(CASES[name], seed=1)
    separate = copy.deepcopy(parts)
    stacked = stack_quantized(parts)
    for layer in (stacked, *separate):
        layer.cpu_kernels = False
    x = _x(5, torch.float32)
    expected = torch.cat([part(x) for part in separate], dim=-1)
    torch.testing.assert_close(stacked(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_parts_become_views_of_the_stacked_tensors(name):
    """No second copy: each part's codes, scales, zero points and bias sit in the stacked
    tensors' storage, and the stacked tensors hold no more than the parts did (but a
    float32 scale, and zero point, per row where a per-tensor one became per channel)."""
    parts = _parts(CASES[name], seed=2)
    before = sum(tensor.nbytes for part in parts for tensor in part.buffers())
    per_tensor = sum(part.out_features * (1 if part.zero is None else 2)  # a per-tensor zero point likewise
                     for part in parts if part.scale is not None and part.scale.numel() == 1)
    stacked = stack_quantized(parts)
    assert sum(tensor.nbytes for tensor in stacked.buffers()) <= before + 4 * per_tensor
    owners = {tensor.untyped_storage().data_ptr() for tensor in stacked.buffers()}
    for part in parts:
        assert {tensor.untyped_storage().data_ptr() for tensor in part.buffers()} <= owners


MIXED: dict[str, tuple[Part, Part]] = {
    "fp8 and int8": (_w8(torch.float8_e4m3fn, "channel"), _w8(torch.int8, "channel")),
    "blocks and channels": (_w8(torch.int8, "blocks", (16, 32)), _w8(torch.int8, "channel")),
    "two block shapes": (_w8(torch.int8, "blocks", (16, 32)), _w8(torch.int8, "blocks", (16, 64))),
    "W8A8 and weight-only": (_w8(torch.int8, "channel", input_quantization="int8"), _w8(torch.int8, "channel")),
    "W8 zero points and none": (_w8(torch.int8, "channel", zero=True), _w8(torch.int8, "channel")),
    "W8 and W4": (_w8(torch.int8, "channel"), _w4(32, zeros=False)),
    "two group sizes": (_w4(32, zeros=False), _w4(64, zeros=False)),
    "zero points and none": (_w4(32, zeros=True), _w4(32, zeros=False)),
    "two act-order permutations": (_w4(32, zeros=True, perm_seed=1), _w4(32, zeros=True, perm_seed=2)),
    "act order and none": (_w4(32, zeros=True, perm_seed=1), _w4(32, zeros=True)),
}


@pytest.mark.parametrize("name", sorted(MIXED))
def test_parts_that_disagree_stay_separate(name):
    first, second = MIXED[name]
    generator = torch.Generator().manual_seed(3)
    parts = [first(64, generator), second(32, generator)]
    assert stack_refusal(parts) is not None


def test_partial_blocks_stack_only_as_the_last_part():
    build = _w8(torch.float8_e4m3fn, "blocks", (16, 32))
    generator = torch.Generator().manual_seed(4)
    assert stack_refusal([build(64, generator), build(40, generator)]) is None  # 40: the last block partial
    assert "whole blocks" in str(stack_refusal([build(40, generator), build(64, generator)]))


@pytest.mark.slow
@pytest.mark.skipif(not (cpu_quant_available() and fused_kernels_available(torch.float32)),
                    reason="the quantized or fused C kernels do not build here")
def test_an_engines_quantized_groups_run_stacked(tmp_path, monkeypatch):
    """An online int8 Qwen3 model on the CPU path: every decoder layer runs q, k and v as
    one stacked call and every MLP its gate and up, the parts being views of them."""
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "fused_kernels=on,quant_kernels=on")  # whatever the run sets
    llm = LLM(str(build_tiny_model(tmp_path, "qwen3")), dtype="float32", device="cpu", quantization="int8")
    model = ckpt.engine_model(llm)
    layers = [module for module in model.modules() if hasattr(module, "stacked_qkv")]
    mlps = [module for module in model.modules() if isinstance(module, StackedGatedMLP)]
    assert layers and len(mlps) == len(layers)
    def storage(layer: torch.nn.Module) -> int:
        assert isinstance(layer, QuantizedLinear) and layer.weight is not None
        return layer.weight.untyped_storage().data_ptr()

    for layer in layers:
        stacked = storage(layer.get_submodule("stacked_qkv"))
        for name in ("q_proj", "k_proj", "v_proj"):
            assert storage(layer.get_submodule(f"layer.self_attn.{name}")) == stacked
    for mlp in mlps:
        assert storage(mlp.get_submodule("mlp.gate_proj")) == storage(mlp.mlp.up_proj) == storage(mlp.gate_up)
