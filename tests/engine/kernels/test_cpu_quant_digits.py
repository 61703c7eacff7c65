"""The decode tiles of the bfloat16 quantized kernel against the float64 product of x
and the dequantized weight on x spanning many binades: the integer tiles
(cpu_quant_digits.h: x in fixed point as three signed byte digits, int8 codes
multiplied by AVX512_VNNI byte products) on the shapes they take (one row of bfloat16
x, scale blocks of whole 64-column chunks) and those they leave to the bfloat16
dot-product tiles (more rows, rows of x they cannot scale), and the 4-bit tiles (runs
of 64 codes, groups of 128 and 256), 1-8 rows, on each build target, with the AMX
tiles (test_cpu_quant_amx.py) kept out of the way."""

import shutil

import pytest
import torch

from shardline.engine.kernels.cpu_quant import allow_amx_tiles, cpu_w4_linear, cpu_w8_linear
from shardline.engine.kernels.quant_reference import dequantize_w4, dequantize_w8

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: quantized linears dequantize through torch"),
              pytest.mark.usefixtures("kernel_target")]


@pytest.fixture(autouse=True)
def _without_amx():
    allow_amx_tiles(False)
    yield
    allow_amx_tiles(True)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def wide_range_x(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bfloat16 rows spanning many binades: an outlier 1000x the rest, values down to
    1e-6 of it, exact zeros, and one row of zeros where there are several rows."""
    x = torch.randn(rows, cols, generator=generator(seed))
    x *= torch.pow(10.0, -3 * torch.rand(rows, cols, generator=generator(seed + 1)))
    x[:, 3] = 1000.0
    x[:, 5] = 0.0
    if rows > 2:
        x[1] = 0.0
    return x.bfloat16()


def assert_product(out: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> None:
    """One bfloat16 rounding of the exact product: within one bfloat16 step of each
    output (2^-8 relative) and a float32-sized share of the row's largest term."""
    exact = x.double() @ dense.double().t() + (0.0 if bias is None else bias.double())
    terms = (x.double().abs() @ dense.double().abs().t()).amax(dim=1, keepdim=True)
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    error = (out.double() - exact).abs()
    bound = exact.abs() * 2.0 ** -8 + terms * 2.0 ** -20 + 1e-30
    assert bool((error <= bound).all()), f"largest excess {(error - bound).max().item()}"


@pytest.mark.parametrize("scale_kind", ["channel", "block128x64", "block128x96"])
@pytest.mark.parametrize("out_features,in_features", [(34, 448), (17, 1000)])
def test_w8_int8_rows_of_x(scale_kind, out_features, in_features):
    """1-8 rows, every int8 code (-128 included), K with and without a partial last
    chunk of 64; blocks of 96 columns are not whole chunks (the bfloat16 tiles)."""
    codes = torch.arange(out_features * in_features) % 256 - 128
    weight = codes[torch.randperm(codes.numel(), generator=generator(0))].view(out_features, in_features)
    weight = weight.to(torch.int8)
    block = {"channel": None, "block128x64": (128, 64), "block128x96": (128, 96)}[scale_kind]
    shape = (out_features, 1) if block is None else (-(-out_features // block[0]), -(-in_features // block[1]))
    scale = torch.rand(shape, generator=generator(1)) * 0.02 + 0.001
    bias = torch.randn(out_features, generator=generator(2)).bfloat16()
    dense = dequantize_w8(weight, scale, block)
    for rows in range(1, 9):
        x = wide_range_x(rows, in_features, rows)
        with_bias = bias if rows % 2 else None
        assert_product(cpu_w8_linear(x, weight, scale, block, with_bias), x, dense, with_bias)


@pytest.mark.parametrize("group_size,in_features", [(128, 384), (256, 512)])
@pytest.mark.parametrize("with_zeros", [False, True], ids=["symmetric", "zeros"])
def test_w4_rows_of_x(group_size, in_features, with_zeros):
    out_features = 19
    packed = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=generator(1))
    groups = (out_features, in_features // group_size)
    scales = torch.rand(groups, generator=generator(2)) * 0.05 + 0.005
    zeros = torch.randint(0, 16, groups, generator=generator(3)).float() if with_zeros else None
    bias = torch.randn(out_features, generator=generator(4)).bfloat16()
    dense = dequantize_w4(packed, scales, zeros, group_size)
    for rows in range(1, 9):
        x = wide_range_x(rows, in_features, 10 + rows)
        with_bias = bias if rows % 2 else None
        assert_product(cpu_w4_linear(x, packed, scales, zeros, group_size, with_bias), x, dense, with_bias)


@pytest.mark.parametrize("magnitude", [1e-35, 1e33], ids=["below_2^-105", "large"])
def test_rows_at_the_ends_of_the_range(magnitude):
    """A row whose largest value is below 2^-105 is left to the bfloat16 tiles; a large
    one (its unscaled sums still float32) is scaled like any other."""
    weight = torch.randint(-127, 128, (8, 256), dtype=torch.int8, generator=generator(5))
    scale = torch.full((8, 1), 1e-3)
    x = (torch.rand(2, 256, generator=generator(6)) * magnitude).bfloat16()
    dense = dequantize_w8(weight, scale)
    assert_product(cpu_w8_linear(x, weight, scale), x, dense, None)
    packed = torch.randint(0, 256, (8, 128), dtype=torch.uint8, generator=generator(7))
    scales = torch.full((8, 2), 1e-3)
    assert_product(cpu_w4_linear(x, packed, scales, None, 128), x, dequantize_w4(packed, scales, None, 128), None)


def test_non_finite_x_gives_what_the_reference_gives():
    """A row holding inf or NaN is left to the bfloat16 tiles (the digits cannot hold it)."""
    weight = torch.randint(1, 127, (4, 128), dtype=torch.int8, generator=generator(8))
    scale = torch.full((4, 1), 1e-2)
    x = torch.ones(3, 128).bfloat16()
    x[0, 7], x[2, 9] = float("inf"), float("nan")
    out = cpu_w8_linear(x, weight, scale)
    assert bool(torch.isinf(out[0]).all()) and bool(torch.isnan(out[2]).all())
    assert_product(out[1:2], x[1:2], dequantize_w8(weight, scale), None)
