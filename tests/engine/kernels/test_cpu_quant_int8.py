"""The W8A8 int8 linear (cpu_quant_int8.c, integer products through AVX512_VNNI) against
the plain-torch reference of compressed-tensors' forward (x quantized per token, then
the float32 product of the dequantized weight), on each build target: where a target
has no VNNI the layer's dispatch takes the weight-only kernels over x's dequantized
codes, checked against the same reference."""

import shutil

import pytest
import torch

from shardline.engine.kernels import cpu_quant_int8
from shardline.engine.kernels.cpu_quant_int8 import cpu_int8_token_codes, cpu_w8a8_available, cpu_w8a8_linear
from shardline.engine.kernels.native import cpu_signature
from shardline.engine.quantization.activations import fake_quantize_inputs, int8_token_codes, w8a8_reference
from shardline.engine.quantization.linear import QuantizedLinear, quantized_matmul

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: W8A8 linears take the torch path"),
              pytest.mark.usefixtures("kernel_target")]  # each build target in turn

DTYPES = [torch.float32, torch.bfloat16]
# The kernel's blocks of 6 rows of x (then 4, 2, 1) and tiles of 4 weight rows with
# every remainder; columns with and without a tail of the 64-byte step.
SHAPES = [(1, 7, 5), (2, 4, 64), (3, 9, 70), (6, 33, 100), (7, 64, 128), (11, 40, 192), (13, 130, 1000),
          (64, 96, 256), (300, 20, 72)]


def _inputs(dtype, rows, cols, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=generator) * 3).to(dtype)
    x[0] = 0  # a zero token: its scale is the dtype's epsilon, its codes 0
    if rows > 1:
        x[1, 0] = x[1].abs().max() * -1  # the token's largest magnitude negative: code -128 from -127.5
    return x, generator


def assert_close_to_reference(out, expected):
    """float32: the reference's float32 sums up to their order; bfloat16: the reference
    also rounds the dequantized x to bfloat16 before multiplying (a few bfloat16 steps)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    scale = expected.float().abs().max().item()
    tolerance = 1e-5 if out.dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance * scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_codes_are_compressed_tensors_codes(dtype):
    """The kernel's per-token codes and scales are exactly the reference's (x's dtype),
    on every target (AVX512_VNNI's quantization and the plain one)."""
    x, _ = _inputs(dtype, 9, 300)
    codes, scales, sums = cpu_int8_token_codes(x)
    expected_codes, expected_scales = int8_token_codes(x)
    assert torch.equal(codes, expected_codes)
    assert torch.equal(scales, expected_scales.float().view(-1))
    assert torch.equal(sums, expected_codes.int().sum(-1))
    assert codes.min().item() == -128 and codes.max().item() == 127


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("per_channel", [True, False])
def test_w8a8_linear_matches_reference(dtype, shape, per_channel):
    rows, out_features, in_features = shape
    x, generator = _inputs(dtype, rows, in_features)
    weight = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    scale = torch.rand(out_features if per_channel else 1, 1, generator=generator) * 1e-2
    bias = torch.randn(out_features, generator=generator).to(dtype)
    expected = w8a8_reference(x, weight, scale, bias)
    layer = QuantizedLinear.w8(weight, scale, None, bias)
    layer.input_quantization = "int8"
    assert_close_to_reference(quantized_matmul(layer, x), expected)  # the kernel where it builds
    if cpu_w8a8_available(dtype):
        assert_close_to_reference(cpu_w8a8_linear(x, weight, scale, bias), expected)
        assert_close_to_reference(cpu_w8a8_linear(x, weight, scale), w8a8_reference(x, weight, scale, None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [256, 203, 5])  # whole vectors, a scalar tail, only a tail
def test_fake_quantized_inputs_equal_the_reference_bit_for_bit(dtype, cols):
    """The C pass (every target) gives fake_quantize_inputs' values exactly: tokens of
    every magnitude, a zero token (the dtype's epsilon), each code end, ties at the
    half steps; a NaN or infinite element makes its whole token NaN, as in torch."""
    x, generator = _inputs(dtype, 8, cols)
    x[2] *= torch.logspace(-30, 30, cols).to(dtype)
    x[3] = (torch.arange(cols) - cols // 2).to(dtype) * 0.5  # halves: x / scale lands on ties
    x[4, -1] = float("nan")
    x[5, 0] = float("inf")
    x[6] = 1e-38  # subnormal scale in bfloat16 / float32 arithmetic
    assert cpu_quant_int8.cpu_int8_fake_quantize_available(dtype)
    out = cpu_quant_int8.cpu_int8_fake_quantize(x)
    expected = fake_quantize_inputs(x, "int8")
    assert out.dtype == dtype and torch.equal(out.isnan(), expected.isnan())
    assert out[4:6].isnan().all()
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())
    strided = torch.cat([x, x], dim=1)[:, :cols]  # rows a stride apart
    assert torch.equal(cpu_quant_int8.cpu_int8_fake_quantize(strided).nan_to_num(), expected.nan_to_num())


def test_the_reference_differs_from_weight_only():
    """Quantizing x moves the product by more than float rounding: the tests above see it."""
    x, generator = _inputs(torch.float32, 8, 256)
    weight = torch.randint(-128, 128, (32, 256), dtype=torch.int8, generator=generator)
    scale = torch.full((32, 1), 1e-2)
    weight_only = (x @ (weight.float() * scale).t())
    difference = (w8a8_reference(x, weight, scale, None) - weight_only).abs().max() / weight_only.abs().max()
    assert difference > 1e-3
    assert not torch.equal(fake_quantize_inputs(x, "int8"), x)


def test_launcher_checks_its_layout():
    if not cpu_w8a8_available(torch.float32):
        pytest.skip("no integer W8A8 kernel (AVX512_VNNI or AVX2) in this target's build")
    x = torch.randn(2, 32)
    with pytest.raises(AssertionError):
        cpu_w8a8_linear(x, torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 1))
    with pytest.raises(AssertionError, match="W8A8 scale"):
        cpu_w8a8_linear(x, torch.zeros(8, 32, dtype=torch.int8), torch.ones(2, 4))
    with pytest.raises(AssertionError):
        cpu_w8a8_linear(x.double(), torch.zeros(8, 32, dtype=torch.int8), torch.ones(8, 1))
    assert not cpu_w8a8_available(torch.float16)


def test_vnni_kernel_builds_where_the_cpu_has_it(kernel_target):
    """The integer kernel builds for the host's own target where it has AVX512_VNNI, and
    its AVX2 one where the target has AVX2 but not VNNI (x86-64-v3); plain x86-64 takes
    the weight-only kernels (checked above through the dispatch)."""
    flags = set(cpu_signature().decode().split())
    vnni = kernel_target == "native" and {"avx512_vnni", "avx512bw", "avx512vl"} <= flags
    assert (cpu_quant_int8._vnni_library() is not None) == vnni
    avx2 = not vnni and (kernel_target == "x86-64-v3" or (kernel_target == "native" and "avx2" in flags))
    assert cpu_quant_int8._LIBRARY.load().quant_int8_kernel() == (2 if vnni else 1 if avx2 else 0)
    assert cpu_quant_int8.w8a8_kernel_isa() == ("AVX512_VNNI" if vnni else "AVX2" if avx2 else None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_avx2_kernel_takes_the_decode_rows(dtype, monkeypatch):
    """On an AVX2 build the integer kernel runs up to W8A8_AVX2_MAX_ROWS rows of x (its
    result differs from the weight-only kernels' on the same codes only in rounding) and
    more rows take the weight-only kernels on x fake-quantized."""
    library = cpu_quant_int8._LIBRARY.load()
    if library is None or library.quant_int8_kernel() != 1:
        pytest.skip("this target's build has no AVX2 W8A8 kernel")
    calls = []
    monkeypatch.setattr(cpu_quant_int8, "cpu_w8_linear", lambda *args, **kwargs: calls.append(args) or
                        quantized_matmul(QuantizedLinear.w8(args[1], args[2], None, kwargs.get("bias")), args[0]))
    for rows in (1, cpu_quant_int8.W8A8_AVX2_MAX_ROWS, cpu_quant_int8.W8A8_AVX2_MAX_ROWS + 1):
        x, generator = _inputs(dtype, rows, 200)
        weight = torch.randint(-128, 128, (24, 200), dtype=torch.int8, generator=generator)
        scale = torch.rand(24, 1, generator=generator) * 1e-2
        assert_close_to_reference(cpu_w8a8_linear(x, weight, scale), w8a8_reference(x, weight, scale, None))
        assert len(calls) == (rows > cpu_quant_int8.W8A8_AVX2_MAX_ROWS)
