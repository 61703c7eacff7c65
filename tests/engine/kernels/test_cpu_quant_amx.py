"""The AMX decode tiles of the bfloat16 quantized kernel (cpu_quant_amx.h: fp8, int8
and 4-bit weight rows decoded by byte tables into A tiles, x's rows as B tiles) and its
AMX chunk products of the register-blocked kernel, against the float64 product of x
and the dequantized weight, where the host grants the tiles; each also with the tiles
disallowed, where the AVX-512 paths run the same shapes."""

import pytest
import torch

from shardline.engine.kernels.cpu_quant import (
    allow_amx_tiles,
    amx_tiles_ready,
    cpu_quant_available,
    cpu_w4_linear,
    cpu_w8_linear,
)
from shardline.engine.kernels.quant_reference import dequantize_w4, dequantize_w8

pytestmark = pytest.mark.skipif(not cpu_quant_available(torch.bfloat16) or not amx_tiles_ready(),
                                reason="no AMX tiles for the quantized kernels on this host")


@pytest.fixture(params=[True, False], ids=["amx", "no_amx"])
def amx(request):
    allow_amx_tiles(request.param)
    yield request.param
    allow_amx_tiles(True)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def every_code(dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    """Every byte in turn (fp8 without its NaN codes), shuffled: int8 -128 included."""
    codes = (torch.arange(rows * cols) % 256).to(torch.uint8)
    if dtype == torch.float8_e4m3fn:
        codes[(codes & 0x7F) == 0x7F] = 0x3F
    codes = codes[torch.randperm(codes.numel(), generator=generator(0))]
    return codes.view(rows, cols).view(dtype)


def assert_product(out: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> None:
    """One bfloat16 rounding of the exact product (2^-8 of each output) and float32
    sums (2^-20 of the row's largest sum of magnitudes)."""
    exact = x.double() @ dense.double().t() + (0.0 if bias is None else bias.double())
    terms = (x.double().abs() @ dense.double().abs().t()).amax(dim=1, keepdim=True)
    error = (out.double() - exact).abs()
    assert bool((error <= exact.abs() * 2.0 ** -8 + terms * 2.0 ** -20).all())


@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("block", [None, (128, 128), (16, 64)], ids=["channel", "block128", "block16x64"])
def test_w8_decode_rows(weight_dtype, block):
    """1-16 rows of x (the decode shapes and the register-blocked kernel's first), 37
    output rows (a tile of 16 short), K of whole 64-column chunks and not."""
    for in_features in (384, 200):
        weight = every_code(weight_dtype, 37, in_features)
        shape = (37, 1) if block is None else (-(-37 // block[0]), -(-in_features // block[1]))
        scale = torch.rand(shape, generator=generator(1)) * 0.02 + 0.001
        bias = torch.randn(37, generator=generator(2)).bfloat16()
        dense = dequantize_w8(weight, scale, block)
        for rows in range(1, 17):
            x = torch.randn(rows, in_features, generator=generator(rows)).bfloat16()
            with_bias = bias if rows % 2 else None
            assert_product(cpu_w8_linear(x, weight, scale, block, with_bias), x, dense, with_bias)


def test_nan_fp8_codes_give_nan():
    weight = torch.full((16, 128), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 1.0
    weight[3, 70] = torch.tensor(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = cpu_w8_linear(torch.ones(4, 128).bfloat16(), weight, torch.ones(16, 1))
    assert bool(out[:, 3].isnan().all()) and not bool(out[:, :3].isnan().any())


@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("group_size,in_features", [(128, 384), (256, 512), (64, 320)])
@pytest.mark.parametrize("with_zeros", [False, True], ids=["symmetric", "zeros"])
def test_w4_decode_rows(group_size, in_features, with_zeros):
    """1-16 rows, 21 output rows; groups of 64 are not whole 128-column steps (the
    AVX-512 tiles take them)."""
    packed = torch.randint(0, 256, (21, in_features // 2), dtype=torch.uint8, generator=generator(3))
    groups = (21, in_features // group_size)
    scales = torch.rand(groups, generator=generator(4)) * 0.05 + 0.005
    zeros = torch.randint(0, 16, groups, generator=generator(5)).float() if with_zeros else None
    bias = torch.randn(21, generator=generator(6)).bfloat16()
    dense = dequantize_w4(packed, scales, zeros, group_size)
    for rows in range(1, 17):
        x = torch.randn(rows, in_features, generator=generator(20 + rows)).bfloat16()
        with_bias = bias if rows % 2 else None
        assert_product(cpu_w4_linear(x, packed, scales, zeros, group_size, with_bias), x, dense, with_bias)
