"""The quantized-weight Triton kernels (interpreted on CPU) against quant_reference.py.

Shapes are odd on purpose (partial M, N and K tiles, partial scale blocks); every case
runs with M = 1 and with several tile rows, in float16, bfloat16 and float32.
"""

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from shardline.engine.kernels import triton_available
from shardline.engine.kernels.quant_reference import (
    dequantize_w4,
    dequantize_w8,
    quantized_linear_reference,
)

from .conftest import DEVICE

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Both sides round the same float32 product to the activation's dtype once; they differ
# by summation order, so by at most an ulp or so of the output.
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def activations(num_rows: int, in_features: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, in_features, generator=generator).to(DEVICE, dtype)


def make_w8(out_features: int, in_features: int, weight_dtype: torch.dtype, scale_kind, seed: int = 0):
    """A W8 weight and its float32 scale: "tensor", "channel" or a (bn, bk) block. Weights
    span the format's range; scales bring each output to order one."""
    generator = torch.Generator().manual_seed(seed)
    if weight_dtype == torch.int8:
        weight = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
        magnitude = 127.0
    else:
        weight = (torch.randn(out_features, in_features, generator=generator) * 100).clamp(-448, 448)
        weight = weight.to(torch.float8_e4m3fn)
        magnitude = 100.0
    if scale_kind == "tensor":
        shape = (1, 1)
    elif scale_kind == "channel":
        shape = (out_features, 1)
    else:
        shape = (-(-out_features // scale_kind[0]), -(-in_features // scale_kind[1]))
    scale = (torch.rand(shape, generator=generator) + 0.5) / (magnitude * in_features ** 0.5)
    return weight.to(DEVICE), scale.to(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, slack: float = 1.0) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol, atol = (slack * tolerance for tolerance in TOLERANCES[expected.dtype])
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


W8_CASES = [
    ("tensor", None), ("channel", None), ((128, 128), (128, 128)), ((16, 32), (16, 32)), ((24, 40), (24, 40)),
    ((1, 40), (1, 40)),  # compressed-tensors int8 groups: blocks of one row
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("scale_kind, block", W8_CASES, ids=["tensor", "channel", "block128", "block16x32",
                                                               "block24x40_per_element", "group40"])
def test_w8_linear_matches_reference(scale_kind, block, weight_dtype, dtype):
    from shardline.engine.kernels.quant_linear import triton_w8_linear

    weight, scale = make_w8(136, 200, weight_dtype, scale_kind)  # partial N, K and scale blocks
    bias = torch.randn(136).to(DEVICE)
    expected_weight = dequantize_w8(weight, scale, block)
    for num_rows in (1, 37):
        x = activations(num_rows, 200, dtype)
        expected = quantized_linear_reference(x, expected_weight, bias)
        assert_close(triton_w8_linear(x, weight, scale, block, bias), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_kind", ["tensor", "channel"])
def test_asymmetric_int8_linear_matches_reference(scale_kind, dtype):
    """Zero points far from 0 over the whole int8 range, 1 to 16 rows and 37, odd K."""
    from shardline.engine.kernels.quant_linear import triton_w8_linear

    weight, scale = make_w8(136, 199, torch.int8, scale_kind)
    generator = torch.Generator().manual_seed(5)
    zero = torch.randint(-120, 121, tuple(scale.shape), generator=generator).float().to(DEVICE)
    bias = torch.randn(136).to(DEVICE)
    expected_weight = dequantize_w8(weight, scale, None, zero)
    assert not torch.equal(expected_weight, dequantize_w8(weight, scale, None))
    for num_rows in (*range(1, 17), 37):
        x = activations(num_rows, 199, dtype)
        expected = quantized_linear_reference(x, expected_weight, bias)
        assert_close(triton_w8_linear(x, weight, scale, None, bias, zero=zero), expected, slack=2.0)
        assert_close(triton_w8_linear(x, weight, scale, None, bias, zero=zero, split_k=2), expected, slack=2.0)


def test_the_cuda_dispatch_hands_an_asymmetric_layer_its_zero_points():
    """QuantizedLinear's CUDA path (called here directly) runs the Triton kernel with the
    layer's zero points: it computes what the layer's torch path computes."""
    from shardline.engine.quantization.linear import QuantizedLinear, cuda_kernel_matmul, torch_quantized_matmul

    weight, scale = make_w8(72, 99, torch.int8, "channel")
    zero = torch.randint(-120, 121, tuple(scale.shape), generator=torch.Generator().manual_seed(6)).float()
    layer = QuantizedLinear.w8(weight, scale, None, torch.randn(72).to(DEVICE), zero=zero.to(DEVICE))
    x = activations(3, 99, torch.float32)
    assert_close(cuda_kernel_matmul(layer, x), torch_quantized_matmul(layer, x))


def test_w8_linear_keeps_leading_dims_and_strided_rows():
    from shardline.engine.kernels.quant_linear import triton_w8_linear

    weight, scale = make_w8(48, 64, torch.float8_e4m3fn, "channel")
    wide = activations(6, 96, torch.float32)  # rows of 96 read 64 at a time: a strided view
    x = wide[:, :64].reshape(2, 3, 64)
    out = triton_w8_linear(x, weight, scale, None, None)
    assert out.shape == (2, 3, 48)
    assert_close(out, quantized_linear_reference(x.reshape(6, 64), dequantize_w8(weight, scale)).reshape(2, 3, 48))


def test_w8_linear_refuses_bad_layouts():
    from shardline.engine.kernels.quant_linear import triton_w8_linear

    weight, scale = make_w8(48, 64, torch.float8_e4m3fn, (16, 16))
    x = activations(2, 64, torch.float32)
    with pytest.raises(AssertionError, match=r"block \(16, 32\) scale \(3, 4\), expected \(3, 2\)"):
        triton_w8_linear(x, weight, scale, (16, 32), None)
    with pytest.raises(AssertionError, match="neither per tensor"):
        triton_w8_linear(x, weight, scale, None, None)
    with pytest.raises(AssertionError, match="scale torch.float16"):
        triton_w8_linear(x, weight, scale.half(), (16, 16), None)
    with pytest.raises(TypeError, match="float64"):
        triton_w8_linear(x.double(), weight, scale, (16, 16), None)
    with pytest.raises(AssertionError, match="x has 63 features"):
        triton_w8_linear(x[:, :63], weight, scale, (16, 16), None)
    with pytest.raises(AssertionError, match=r"weight torch.float16"):
        triton_w8_linear(x, weight.half(), scale, (16, 16), None)


def test_w8_linear_decodes_every_fp8_code():
    """Every E4M3 code, subnormals and both zeros included, through the kernel's own decoding
    of the bits; the nan code gives nan, as the reference's cast does."""
    from shardline.engine.kernels.quant_linear import triton_w8_linear

    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]  # 254 codes
    weight = torch.stack([finite.roll(shift) for shift in range(0, 254, 16)]).view(torch.float8_e4m3fn)
    scale = torch.full((weight.shape[0], 1), 1.0 / 448)
    x = torch.zeros(weight.shape[0], 254)
    x[torch.arange(weight.shape[0]), torch.arange(weight.shape[0]) * 7] = 1.0  # row i reads column 7i
    x += activations(weight.shape[0], 254, torch.float32) * 1e-3
    weight, scale, x = weight.to(DEVICE), scale.to(DEVICE), x.to(DEVICE)
    expected = quantized_linear_reference(x, dequantize_w8(weight, scale))
    assert_close(triton_w8_linear(x, weight, scale, None, None), expected)
    with_nan = weight.view(torch.uint8).clone()
    with_nan[3, 5] = 0xFF
    out = triton_w8_linear(x, with_nan.view(torch.float8_e4m3fn), scale, None, None)
    assert out[:, 3].isnan().all() and not out[:, :3].isnan().any()


@pytest.mark.parametrize("scale_kind, block", [("channel", None), ((16, 32), (16, 32))], ids=["channel", "block"])
def test_w8_linear_reads_fp8_natively(scale_kind, block, monkeypatch):
    """The path GPUs of capability 8.9+ take: FP8 weights read as FP8, not as bytes."""
    from shardline.engine.kernels import quant_linear

    monkeypatch.setattr(quant_linear, "reads_fp8_natively", lambda device: True)
    weight, scale = make_w8(136, 200, torch.float8_e4m3fn, scale_kind)
    assert not quant_linear.weight_operand(weight)[1]
    for num_rows in (1, 37):
        x = activations(num_rows, 200, torch.bfloat16)
        assert_close(quant_linear.triton_w8_linear(x, weight, scale, block, None),
                     quantized_linear_reference(x, dequantize_w8(weight, scale, block)))


def make_w4(out_features: int, in_features: int, group_size: int, asymmetric: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (out_features, in_features // 2), generator=generator, dtype=torch.uint8)
    groups = -(-in_features // group_size)
    scales = (torch.rand(out_features, groups, generator=generator) + 0.5) / (4 * in_features ** 0.5)
    zeros = torch.randint(3, 13, (out_features, groups), generator=generator).float() if asymmetric else None
    return packed.to(DEVICE), scales.to(DEVICE), None if zeros is None else zeros.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size, in_features", [(128, 256), (32, 200), (64, 4 * 64 + 32), (16, 72), (40, 200)],
                         ids=["g128", "g32_partial_k", "g64_partial_group", "g16_per_element", "g40_per_element"])
@pytest.mark.parametrize("asymmetric", [True, False], ids=["zeros", "symmetric"])
def test_w4_linear_matches_reference(asymmetric, group_size, in_features, dtype):
    from shardline.engine.kernels.quant_linear import triton_w4_linear

    packed, scales, zeros = make_w4(72, in_features, group_size, asymmetric)
    bias = torch.randn(72).to(DEVICE) if asymmetric else None
    expected_weight = dequantize_w4(packed, scales, zeros, group_size)
    for num_rows in (1, 37):
        x = activations(num_rows, in_features, dtype)
        expected = quantized_linear_reference(x, expected_weight, bias)
        assert_close(triton_w4_linear(x, packed, scales, zeros, group_size, bias), expected)


@pytest.mark.parametrize("group_size", [32, 16], ids=["per_tile", "per_element"])
def test_w4_linear_reads_transposed_scales_and_zeros(group_size):
    """GPTQ and AWQ store scales and zeros [K // g, N]; the loader hands them over transposed."""
    from shardline.engine.kernels.quant_linear import triton_w4_linear

    packed, scales, zeros = make_w4(40, 128, group_size, True)
    assert zeros is not None
    scales_t, zeros_t = scales.t().contiguous().t(), zeros.t().contiguous().t()
    assert scales_t.stride(1) != 1 and zeros_t.stride(1) != 1
    for num_rows in (1, 19):
        x = activations(num_rows, 128, torch.float32)
        expected = quantized_linear_reference(x, dequantize_w4(packed, scales, zeros, group_size))
        assert_close(triton_w4_linear(x, packed, scales_t, zeros_t, group_size, None), expected)


def test_kernels_take_quantized_linear_layouts():
    """What engine/quantization's QuantizedLinear holds (GPTQ-style transposed float16 group
    scales made float32, a per-tensor FP8 scale, a bfloat16 bias) goes to the kernels as
    is, and they agree with its torch path."""
    from shardline.engine.kernels.quant_linear import triton_w4_linear, triton_w8_linear
    from shardline.engine.quantization.linear import QuantizedLinear, torch_quantized_matmul

    packed, scales, zeros = make_w4(40, 128, 32, True)
    assert zeros is not None
    w4 = QuantizedLinear.w4(packed, scales.t().contiguous().half().t(), zeros.t().contiguous().t(), 32,
                            bias=torch.randn(40).to(DEVICE, torch.bfloat16))
    weight, scale = make_w8(40, 128, torch.float8_e4m3fn, "tensor")
    w8 = QuantizedLinear.w8(weight, scale.reshape(()).reshape(1, 1), None, bias=w4.bias)
    x = activations(3, 128, torch.bfloat16)
    assert w4.packed is not None and w4.scales is not None and w8.weight is not None and w8.scale is not None
    assert_close(triton_w4_linear(x, w4.packed, w4.scales, w4.zeros, w4.group_size, w4.bias),
                 torch_quantized_matmul(w4, x))
    assert_close(triton_w8_linear(x, w8.weight, w8.scale, w8.block, w8.bias), torch_quantized_matmul(w8, x))


def test_w4_linear_with_act_order_permutation():
    """A GPTQ act-order weight: the caller permutes x's columns into the stored order."""
    from shardline.engine.kernels.quant_linear import triton_w4_linear

    packed, scales, zeros = make_w4(40, 128, 32, True)
    input_perm = torch.randperm(128, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    x = activations(3, 128, torch.float32)
    expected = quantized_linear_reference(x, dequantize_w4(packed, scales, zeros, 32), input_perm=input_perm)
    assert_close(triton_w4_linear(x[:, input_perm], packed, scales, zeros, 32, None), expected)
    unpermuted = triton_w4_linear(x, packed, scales, zeros, 32, None)
    assert not torch.allclose(unpermuted, expected, atol=1e-2)


def test_w4_linear_refuses_bad_layouts():
    from shardline.engine.kernels.quant_linear import triton_w4_linear

    packed, scales, zeros = make_w4(40, 128, 32, True)
    x = activations(2, 128, torch.float32)
    with pytest.raises(AssertionError, match=r"scales torch.float32 \(40, 4\), expected float32 \(40, 2\)"):
        triton_w4_linear(x, packed, scales, zeros, 64, None)
    with pytest.raises(AssertionError, match="zeros torch.float16"):
        triton_w4_linear(x, packed, scales, zeros.half(), 32, None)  # type: ignore[union-attr]
    with pytest.raises(AssertionError, match="packed must be"):
        triton_w4_linear(x, packed.to(torch.int8), scales, zeros, 32, None)
    with pytest.raises(AssertionError, match="group_size 33"):
        triton_w4_linear(x, packed, scales, zeros, 33, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [200, 64, 48])
def test_fp8_row_quantization_is_bit_exact(group_size, dtype):
    """The kernel's own rounding onto the E4M3 grid equals torch's cast, scales included;
    the rows span zeros, subnormal E4M3 values and ties."""
    from shardline.engine.kernels.fp8_w8a8 import quantize_fp8_rows, quantize_fp8_rows_reference

    x = activations(5, 200, torch.float32) * torch.logspace(-4, 2, 200).to(DEVICE)
    x[1] = 0.0
    x[2, :100] = 1e-6
    x = x.to(dtype)
    q, scale = quantize_fp8_rows(x, group_size)
    expected_q, expected_scale = quantize_fp8_rows_reference(x, group_size)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))


def test_fp8_reference_rounds_ties_to_even():
    from shardline.engine.kernels.fp8_w8a8 import quantize_fp8_rows

    # With amax 448 the scale is 1; each value lies halfway between two E4M3 neighbours
    # (spacing 1 in [8, 16), 2 in [16, 32), 2^-9 among the subnormals).
    tiny = 2.0 ** -9
    ties = [8.5, 9.5, -8.5, 17.0, 19.0, 2.5 * tiny, 3.5 * tiny]
    x = torch.tensor([[448.0, *ties] + [0.0] * 8]).to(DEVICE)
    q, scale = quantize_fp8_rows(x, 16)
    assert scale.item() == 1.0
    assert q.float()[0, :8].tolist() == [448.0, 8.0, 10.0, -8.0, 16.0, 20.0, 2 * tiny, 4 * tiny]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_kind, block", [("tensor", None), ("channel", None), ((32, 64), (32, 64)),
                                               ((128, 128), (128, 128))],
                         ids=["tensor", "channel", "block32x64", "block128"])
def test_fp8_w8a8_matches_reference(scale_kind, block, dtype):
    from shardline.engine.kernels.fp8_w8a8 import fp8_w8a8_linear, fp8_w8a8_reference

    weight, scale = make_w8(136, 200, torch.float8_e4m3fn, scale_kind)
    bias = torch.randn(136).to(DEVICE)
    for num_rows in (1, 37):
        x = activations(num_rows, 200, dtype)
        expected = fp8_w8a8_reference(x, weight, scale, block, bias)
        assert_close(fp8_w8a8_linear(x, weight, scale, block, bias), expected)
        # The activation's quantization is what differs from the W8A16 product; it stays small.
        weight_only = quantized_linear_reference(x, dequantize_w8(weight, scale, block), bias)
        relative_error = (expected.float() - weight_only.float()).norm() / weight_only.float().norm()
        assert relative_error < 0.05


def test_fp8_w8a8_refuses_blocks_it_cannot_tile():
    from shardline.engine.kernels.fp8_w8a8 import fp8_w8a8_linear

    weight, scale = make_w8(48, 64, torch.float8_e4m3fn, (24, 40))
    with pytest.raises(ValueError, match=r"multiple of 16, got block \(24, 40\)"):
        fp8_w8a8_linear(activations(2, 64, torch.float32), weight, scale, (24, 40), None)
    weight, scale = make_w8(48, 64, torch.int8, "channel")
    with pytest.raises(AssertionError, match="float8_e4m3fn"):
        fp8_w8a8_linear(activations(2, 64, torch.float32), weight, scale, None, None)


def make_mxfp4(num_experts: int, out_features: int, in_features: int, typical_exponent: int, seed: int):
    """MXFP4 blocks and scales with scales within a few binades of 2^typical_exponent."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (num_experts, out_features, in_features // 32, 16), generator=generator,
                           dtype=torch.uint8)
    scales = torch.randint(127 + typical_exponent - 2, 127 + typical_exponent + 1,
                           (num_experts, out_features, in_features // 32), generator=generator, dtype=torch.uint8)
    return blocks.to(DEVICE), scales.to(DEVICE)


@dataclass
class MoeCase:
    """mxfp4_moe's arguments but the activation."""

    hidden: torch.Tensor
    gate_up_blocks: torch.Tensor
    gate_up_scales: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_blocks: torch.Tensor
    down_scales: torch.Tensor
    down_bias: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor

    def run(self, moe: Callable[..., torch.Tensor], activation) -> torch.Tensor:
        return moe(self.hidden, self.gate_up_blocks, self.gate_up_scales, self.gate_up_bias, self.down_blocks,
                   self.down_scales, self.down_bias, self.topk_ids, self.topk_weights, activation)


def make_moe_case(num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, dtype,
                  with_bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    gate_up = make_mxfp4(num_experts, 2 * intermediate, hidden, -3, seed)  # gate_up spans the clamp limit
    down = make_mxfp4(num_experts, hidden, intermediate, -6, seed + 1)
    biases = (torch.randn(num_experts, 2 * intermediate, generator=generator).to(DEVICE),
              torch.randn(num_experts, hidden, generator=generator).to(DEVICE)) if with_bias else (None, None)
    x = activations(num_tokens, hidden, dtype, seed + 2)
    topk_ids = torch.rand(num_tokens, num_experts, generator=generator).argsort(dim=1)[:, :top_k]  # distinct
    topk_weights = torch.randn(num_tokens, top_k, generator=generator).softmax(dim=-1)
    return MoeCase(x, gate_up[0], gate_up[1], biases[0], down[0], down[1], biases[1],
                   topk_ids.to(DEVICE), topk_weights.to(DEVICE))


def moe_activations():
    from shardline.engine.kernels.quant_moe import SILU_GATED_HALVES, GatedActivation

    return {"clamped_swiglu": GatedActivation.clamped_swiglu(alpha=1.702, limit=7.0), "silu": SILU_GATED_HALVES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation, with_bias", [("clamped_swiglu", True), ("silu", False)])
def test_mxfp4_moe_matches_reference(activation, with_bias, dtype):
    from shardline.engine.kernels.quant_moe import mxfp4_moe, mxfp4_moe_reference

    for num_tokens in (1, 9):  # hidden 96: a partial K tile; intermediate 64
        case = make_moe_case(num_tokens, 96, 64, num_experts=5, top_k=2, dtype=dtype, with_bias=with_bias)
        act = moe_activations()[activation]
        expected = case.run(mxfp4_moe_reference, act)
        # Both round the intermediate to the activations' dtype twice (gate_up, then the
        # activation's output): an ulp there, from summation order, reaches the output.
        assert_close(case.run(mxfp4_moe, act), expected, slack=3.0)


def make_w8_experts(num_experts: int, out_features: int, in_features: int, weight_dtype, scale_kind, seed: int):
    """W8 weights [E, N, K] and scales [E, ...] stacked from make_w8's, one expert at a time."""
    pairs = [make_w8(out_features, in_features, weight_dtype, scale_kind, seed=seed + expert)
             for expert in range(num_experts)]
    return torch.stack([weight for weight, _ in pairs]), torch.stack([scale for _, scale in pairs])


W8_MOE_CASES = [
    pytest.param(torch.float8_e4m3fn, (32, 64), torch.bfloat16, "silu", id="fp8_block_bf16"),
    pytest.param(torch.float8_e4m3fn, (32, 64), torch.float32, "clamped_swiglu", id="fp8_block_f32_swiglu"),
    pytest.param(torch.float8_e4m3fn, (32, 64), torch.float16, "silu", id="fp8_block_f16", marks=pytest.mark.slow),
    pytest.param(torch.float8_e4m3fn, "channel", torch.bfloat16, "silu", id="fp8_channel_bf16"),
    pytest.param(torch.int8, "channel", torch.float16, "silu", id="int8_channel_f16"),
    pytest.param(torch.float8_e4m3fn, "tensor", torch.float32, "silu", id="fp8_tensor_f32", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("weight_dtype, scale_kind, dtype, activation", W8_MOE_CASES)
def test_w8_moe_matches_reference(weight_dtype, scale_kind, dtype, activation):
    """FP8/int8 experts (DeepSeek-V3's and Qwen3's FP8 releases: 128x128 blocks) stacked [E, N, K]."""
    from shardline.engine.kernels.quant_moe_w8 import w8_moe, w8_moe_reference

    block = scale_kind if isinstance(scale_kind, tuple) else None
    gate_up = make_w8_experts(5, 128, 96, weight_dtype, scale_kind, seed=0)  # partial K blocks
    down = make_w8_experts(5, 96, 64, weight_dtype, scale_kind, seed=10)
    act = moe_activations()[activation]
    generator = torch.Generator().manual_seed(4)
    biases = (torch.randn(5, 128, generator=generator).to(DEVICE), torch.randn(5, 96, generator=generator).to(DEVICE))
    for num_tokens in (1, 9):
        case = make_moe_case(num_tokens, 96, 64, num_experts=5, top_k=2, dtype=dtype, with_bias=False)
        args = (case.hidden, *gate_up, biases[0], *down, biases[1], block, case.topk_ids, case.topk_weights, act)
        expected = w8_moe_reference(*args)
        assert_close(w8_moe(*args), expected, slack=3.0)
        rerouted = (*args[:8], (case.topk_ids + 1) % 5, *args[9:])
        assert not torch.allclose(w8_moe_reference(*rerouted).float(), expected.float(), atol=1e-2)


def test_w8_moe_refuses_bad_layouts():
    from shardline.engine.kernels.quant_moe_w8 import w8_moe

    gate_up = make_w8_experts(3, 64, 64, torch.float8_e4m3fn, (32, 32), seed=0)
    down = make_w8_experts(3, 64, 32, torch.float8_e4m3fn, (32, 32), seed=5)
    case = make_moe_case(2, 64, 32, num_experts=3, top_k=2, dtype=torch.float32, with_bias=False)
    act = moe_activations()["silu"]
    with pytest.raises(AssertionError, match=r"gate_up block \(32, 64\) scale \(3, 2, 2\), expected \(3, 2, 1\)"):
        w8_moe(case.hidden, *gate_up, None, *down, None, (32, 64), case.topk_ids, case.topk_weights, act)
    with pytest.raises(AssertionError, match="down weight torch.float16"):
        w8_moe(case.hidden, *gate_up, None, down[0].half(), down[1], None, (32, 32), case.topk_ids,
               case.topk_weights, act)


def test_mxfp4_moe_reference_clamps_and_routes():
    """The reference's checks: the clamp limit is reached, and each route matters."""
    from shardline.engine.kernels.quant_moe import mxfp4_moe_reference
    from shardline.engine.kernels.quant_reference import dequantize_mxfp4

    case = make_moe_case(9, 96, 64, num_experts=5, top_k=2, dtype=torch.float32, with_bias=True)
    gate_up = case.hidden @ dequantize_mxfp4(case.gate_up_blocks[0], case.gate_up_scales[0]).t()
    assert (gate_up.abs() > 7.0).any() and (gate_up.abs() < 7.0).any()
    act = moe_activations()["clamped_swiglu"]
    base = case.run(mxfp4_moe_reference, act)
    rerouted = replace(case, topk_ids=(case.topk_ids + 1) % 5)
    assert not torch.allclose(rerouted.run(mxfp4_moe_reference, act), base, atol=1e-3)


def test_mxfp4_moe_skips_routes_outside_the_experts():
    """Routes to an id outside [0, E) contribute nothing (transformers skips them too)."""
    from shardline.engine.kernels.quant_moe import mxfp4_moe

    case = make_moe_case(6, 64, 32, num_experts=4, top_k=2, dtype=torch.float32, with_bias=True)
    act = moe_activations()["clamped_swiglu"]
    skipped = replace(case, topk_ids=case.topk_ids.clone())
    skipped.topk_ids[::2, 1] = 4  # == E
    skipped.topk_ids[1, 0] = -1
    only_kept = replace(case, topk_weights=case.topk_weights.clone())
    only_kept.topk_weights[::2, 1] = 0.0
    only_kept.topk_weights[1, 0] = 0.0
    assert_close(skipped.run(mxfp4_moe, act), only_kept.run(mxfp4_moe, act))


def test_route_blocks_pads_each_expert_to_whole_blocks():
    from shardline.engine.kernels.quant_moe import route_blocks

    topk_ids = torch.tensor([[0, 3], [3, 1], [3, 0], [2, 3], [7, 3]], device=DEVICE)  # 7: outside E = 4
    routes = route_blocks(topk_ids, num_experts=4, block_m=2)
    num_slots = topk_ids.numel()
    rows = routes.row_slots[:routes.max_blocks * 2].view(routes.max_blocks, 2).tolist()
    experts = routes.block_expert.tolist()
    flat = topk_ids.flatten().tolist()
    seen = []
    for block, (expert, slots) in enumerate(zip(experts, rows)):
        real = [slot for slot in slots if slot < num_slots]
        if expert == 4:
            assert not real  # past the last block
            continue
        assert real and all(flat[slot] == expert for slot in real), (block, expert, slots)
        seen += real
    assert sorted(seen) == [slot for slot, expert in enumerate(flat) if expert < 4]
    assert experts == sorted(experts)


def test_mxfp4_moe_refuses_bad_layouts():
    from shardline.engine.kernels.quant_moe import mxfp4_moe

    case = make_moe_case(2, 64, 32, num_experts=4, top_k=2, dtype=torch.float32, with_bias=True)
    act = moe_activations()["silu"]
    with pytest.raises(AssertionError, match=r"down scales torch.int8 \(4, 64, 1\), expected contiguous uint8"):
        replace(case, down_scales=case.down_scales.to(torch.int8)).run(mxfp4_moe, act)
    with pytest.raises(AssertionError, match=r"gate_up blocks torch.uint8 \(4, 32, 2, 16\)"):
        replace(case, gate_up_blocks=case.gate_up_blocks[:, :32].contiguous()).run(mxfp4_moe, act)
    with pytest.raises(AssertionError, match="topk_ids torch.float32"):
        replace(case, topk_ids=case.topk_ids.float()).run(mxfp4_moe, act)
    with pytest.raises(AssertionError, match="gate_up bias"):
        replace(case, gate_up_bias=torch.zeros(4, 10, device=DEVICE)).run(mxfp4_moe, act)


def test_split_k_plans_cover_k_without_empty_splits():
    from shardline.engine.kernels.quant_tiles import plan_tiles

    for in_features, block_k, split_k in [(520, 128, 3), (4096, 128, 5), (200, 64, 16), (64, 64, 4), (12288, 128, 7)]:
        plan = plan_tiles(1, 4096, in_features, block_k, torch.device("cpu"), split_k)
        assert plan.k_per_split % block_k == 0
        assert (plan.split_k - 1) * plan.k_per_split < in_features <= plan.split_k * plan.k_per_split
        assert plan.split_k <= split_k
    assert plan_tiles(1, 4096, 4096, 128, torch.device("cpu"), None).split_k == 1  # chosen by SM count on CUDA


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.slow)])
def test_split_k_sums_partials_once(dtype):
    """K cut into ranges whose float32 partial sums (and the bias) are added after the kernel:
    the same result as one range, for every kernel."""
    from shardline.engine.kernels.fp8_w8a8 import fp8_w8a8_linear, fp8_w8a8_reference
    from shardline.engine.kernels.quant_linear import triton_w4_linear, triton_w8_linear

    bias = torch.randn(72).to(DEVICE)
    fp8_weight, block_scale = make_w8(72, 520, torch.float8_e4m3fn, (32, 128))
    int8_weight, channel_scale = make_w8(72, 520, torch.int8, "channel")
    packed, scales, zeros = make_w4(72, 520, 32, True)
    for num_rows in (1, 37):
        x = activations(num_rows, 520, dtype)
        for split_k in (1, 3):
            assert_close(triton_w8_linear(x, fp8_weight, block_scale, (32, 128), bias, split_k=split_k),
                         quantized_linear_reference(x, dequantize_w8(fp8_weight, block_scale, (32, 128)), bias))
            assert_close(triton_w8_linear(x, int8_weight, channel_scale, None, bias, split_k=split_k),
                         quantized_linear_reference(x, dequantize_w8(int8_weight, channel_scale), bias))
            assert_close(triton_w4_linear(x, packed, scales, zeros, 32, bias, split_k=split_k),
                         quantized_linear_reference(x, dequantize_w4(packed, scales, zeros, 32), bias))
            assert_close(fp8_w8a8_linear(x, fp8_weight, block_scale, (32, 128), bias, split_k=split_k),
                         fp8_w8a8_reference(x, fp8_weight, block_scale, (32, 128), bias))


def test_empty_batches_launch_nothing():
    from shardline.engine.kernels.fp8_w8a8 import fp8_w8a8_linear
    from shardline.engine.kernels.quant_linear import triton_w4_linear, triton_w8_linear
    from shardline.engine.kernels.quant_moe import mxfp4_moe

    x = activations(0, 64, torch.bfloat16).reshape(0, 0, 64)
    weight, scale = make_w8(48, 64, torch.float8_e4m3fn, "channel")
    packed, scales, zeros = make_w4(48, 64, 32, True)
    assert triton_w8_linear(x, weight, scale, None, None).shape == (0, 0, 48)
    assert triton_w4_linear(x, packed, scales, zeros, 32, None).shape == (0, 0, 48)
    assert fp8_w8a8_linear(x, weight, scale, None, None).shape == (0, 0, 48)
    case = make_moe_case(0, 64, 32, num_experts=4, top_k=2, dtype=torch.bfloat16, with_bias=True)
    assert case.run(mxfp4_moe, moe_activations()["silu"]).shape == (0, 64)


CUDA_COMPILE = Path(__file__).with_name("cuda_compile.py")
NON_FP8_CASES = ["w8_fp8_block_bf16", "w8_fp8_block_bf16_split_k", "w8_int8_channel_fp16", "w8_fp8_per_element_bf16",
                 "w4_group_bf16", "w4_per_element_fp16", "mxfp4_moe_bf16", "w8_moe_fp8_block_bf16"]
FP8_W8A8_CASES = ["fp8_w8a8_channel_bf16", "fp8_w8a8_block_bf16"]


def compile_for_cuda(capability: int, cases: list[str]) -> list[str]:
    """cuda_compile.py's report lines, run without the interpreter in a fresh process."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend is not installed")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(CUDA_COMPILE), str(capability), *cases], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert {line.split()[0] for line in lines} == set(cases), lines
    return lines


def test_kernels_compile_for_hopper():
    """Triton's real compiler (through ptxas) takes every kernel for sm_90, which the
    interpreter never checks."""
    lines = compile_for_cuda(90, NON_FP8_CASES + FP8_W8A8_CASES)
    assert all(line.endswith(" ok") for line in lines), "\n".join(lines)


@pytest.mark.slow
def test_kernels_compile_for_ampere_and_ada():
    """The weight-only kernels compile for sm_80 (no FP8 types there: FP8 weights are read
    as bytes), FP8 W8A8 for sm_89; on sm_80 FP8 W8A8 cannot compile, which its launcher refuses."""
    lines = compile_for_cuda(80, NON_FP8_CASES)
    assert all(line.endswith(" ok") for line in lines), "\n".join(lines)
    lines = compile_for_cuda(89, FP8_W8A8_CASES)
    assert all(line.endswith(" ok") for line in lines), "\n".join(lines)
    lines = compile_for_cuda(80, FP8_W8A8_CASES[:1])
    assert any("FAIL" in line and "fp8e4nv" in line for line in lines), "\n".join(lines)
