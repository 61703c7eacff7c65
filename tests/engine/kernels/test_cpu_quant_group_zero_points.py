"""Asymmetric int8 with group zero points (compressed-tensors ``symmetric: false``,
strategy group: scales and int8 zero points [N, K / g], W8 blocks of one row by a group)
on cpu_quant.c's kernels against quant_reference, on each build target: the decode
tiles and the prefill panels (the packed panel fill takes zero points per row only, so
such a weight's panels are dequantized by cpu_quant.c)."""

import shutil

import pytest
import torch

from shardline.engine.kernels import cpu_quant
from shardline.engine.kernels.cpu_quant import cpu_w8_linear
from shardline.engine.kernels.quant_reference import dequantize_w8, quantized_linear_reference

from .test_cpu_quant import assert_matches, generator, w8_weight

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: quantized linears dequantize through torch"),
              pytest.mark.usefixtures("kernel_target")]  # each build target in turn

# A decode tile remainder, a full tile pair, a register-blocked count and a prefill's.
ROWS = [1, 3, 8, 37, 300]


def group_weight(out_features: int, in_features: int, group: int) -> tuple[torch.Tensor, ...]:
    """(int8 codes, scale, int8 zero points [N, ceil(K / group)]) with every int8 end."""
    weight = w8_weight(torch.int8, out_features, in_features)
    shape = (out_features, -(-in_features // group))
    scale = torch.rand(shape, generator=generator(2)) * 0.01 + 0.001
    zero = torch.randint(-128, 128, shape, generator=generator(3), dtype=torch.int8)
    zero[0, 0], zero[-1, -1] = -128, 127  # code - zero spans [-255, 255]
    return weight, scale, zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features,group", [(37, 203, 40), (64, 128, 32)])
def test_w8_linear_group_zero_points(dtype, out_features, in_features, group):
    """(37, 203) by groups of 40: a partial last group, rows not a whole tile."""
    weight, scale, zero = group_weight(out_features, in_features, group)
    bias = torch.randn(out_features, generator=generator(4))
    dense = dequantize_w8(weight, scale, (1, group), zero)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=generator(rows)).to(dtype)
        with_bias = bias.to(dtype) if rows % 2 else None
        out = cpu_w8_linear(x, weight, scale, (1, group), with_bias, zero=zero)
        assert_matches(out, quantized_linear_reference(x, dense, with_bias), rows, many_rows=0)


def test_bfloat16_decode_call_binds_group_zero_points():
    """The bound bfloat16 decode call (the engine's decode steps) reads the group zero points."""
    weight, scale, zero = group_weight(48, 96, 32)
    call = cpu_quant.w8_decode_call(weight, scale, (1, 32), None, zero)
    if call is None:
        pytest.skip("no bfloat16 decode kernel built on this target")
    x = torch.randn(4, 96, generator=generator(5)).to(torch.bfloat16)
    expected = quantized_linear_reference(x, dequantize_w8(weight, scale, (1, 32), zero))
    assert_matches(call(x), expected, x.shape[0], many_rows=0)
