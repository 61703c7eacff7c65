"""The CPU quantized linears (C, through ctypes) against quant_reference's
dequantize-then-multiply, for every W8 scale kind and W4 group, every path (the
streaming decode kernel, bfloat16's register-blocked kernel on AVX512_BF16 builds, and
the prefill panels), on each build target."""

import shutil

import pytest
import torch

from shardline.engine.kernels import cpu_quant, cpu_quant_panel
from shardline.engine.kernels.cpu_quant import (
    DECODE_MAX_ROWS,
    PACKED_MIN_ROWS,
    TILE_MAX_ROWS,
    cpu_quant_available,
    cpu_w4_linear,
    cpu_w8_linear,
)
from shardline.engine.kernels.native import cpu_signature
from shardline.engine.kernels.quant_reference import (
    dequantize_w4,
    dequantize_w8,
    quantized_linear_reference,
)

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: quantized linears dequantize through torch"),
              pytest.mark.usefixtures("kernel_target")]  # each build target in turn

DTYPES = [torch.float32, torch.bfloat16]
# Each remainder of the kernels' tiles of x rows, both sides of DECODE_MAX_ROWS, of the
# wide decode tile's instances (cpu_quant_wide.h: 12 and 16 rows) and of TILE_MAX_ROWS,
# and a prefill's many.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, DECODE_MAX_ROWS, DECODE_MAX_ROWS + 1, 12, 13, 16, 17, 32, 33, 40, TILE_MAX_ROWS,
        TILE_MAX_ROWS + 1, 300]


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, rows: int, many_rows: int = TILE_MAX_ROWS) -> None:
    """float32: the reference's float32 product up to the order of its sums. 16-bit:
    one rounding of the float32 sum on the decode and register-blocked paths; on the
    prefill path the panel also rounds each dequantized weight to x's dtype (bfloat16:
    a relative 2^-9). ``many_rows``: up to how many rows the layout takes the
    register-blocked kernel (TILE_MAX_ROWS; 0 where it does not)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    scale = expected.float().abs().max().item()
    if out.dtype == torch.float32:
        rtol, atol = 1e-5, 1e-5
    elif rows <= DECODE_MAX_ROWS or (rows <= many_rows and out.dtype == torch.bfloat16
                                     and cpu_quant._bf16_dot_library() is not None):
        rtol, atol = 8e-3, 1e-3
    else:
        rtol, atol = 2e-2, 1e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol * scale)


def w8_weight(dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    values = torch.randn(rows, cols, generator=generator(1))
    if dtype == torch.int8:
        return (values * 40).round().clamp(-127, 127).to(torch.int8)
    return (values * 60).to(torch.float8_e4m3fn)  # every exponent, subnormals included


W8_SCALES = {  # name: (scale shape from (N, K), block)
    "tensor": (lambda n, k: (1, 1), None),
    "channel": (lambda n, k: (n, 1), None),
    "block128": (lambda n, k: (-(-n // 128), -(-k // 128)), (128, 128)),
    "block_64x32": (lambda n, k: (-(-n // 64), -(-k // 32)), (64, 32)),
    # blocks of an odd width: the register-blocked kernel's pairs of columns start
    # odd and end in a lone column
    "block_16x25": (lambda n, k: (-(-n // 16), -(-k // 25)), (16, 25)),
    # compressed-tensors int8 group scales [N, K / g]: blocks of one row by a group
    "group_40": (lambda n, k: (n, -(-k // 40)), (1, 40)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("scale_kind", list(W8_SCALES))
@pytest.mark.parametrize("out_features,in_features", [(256, 256), (101, 200)])
def test_w8_linear(dtype, weight_dtype, scale_kind, out_features, in_features):
    """(101, 200) ends in partial blocks, a tile (and a panel) of weight rows short and
    a row of x not a whole number of vectors."""
    assert cpu_quant_available(dtype)
    weight = w8_weight(weight_dtype, out_features, in_features)
    shape, block = W8_SCALES[scale_kind]
    scale = torch.rand(shape(out_features, in_features), generator=generator(2)) * 0.02 + 0.001
    bias = torch.randn(out_features, generator=generator(3))
    dense = dequantize_w8(weight, scale, block)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=generator(rows)).to(dtype)
        with_bias = bias.to(dtype) if rows % 2 else None
        out = cpu_w8_linear(x, weight, scale, block, with_bias)
        assert_matches(out, quantized_linear_reference(x, dense, with_bias), rows)


# Each decode tile remainder past two tiles, a register-blocked and a prefill row count.
ASYMMETRIC_ROWS = [*range(1, 17), 37, 300]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_kind", ["tensor", "channel"])
@pytest.mark.parametrize("out_features,in_features", [(37, 203), (64, 128)])
def test_w8_linear_asymmetric_int8(dtype, zero_kind, out_features, in_features):
    """int8 codes less zero points (every int8 value) times the scale: the decode tiles
    (AVX2's pairs of vectors, a single vector and a tail at K = 203) and the prefill panels."""
    weight = w8_weight(torch.int8, out_features, in_features)
    shape = (1, 1) if zero_kind == "tensor" else (out_features, 1)
    scale = torch.rand(shape, generator=generator(2)) * 0.01 + 0.001
    zero = torch.randint(-128, 128, shape, generator=generator(3)).float()
    if zero_kind == "channel":
        zero[:2] = torch.tensor([[-128.0], [127.0]])  # code - zero spans [-255, 255]
    bias = torch.randn(out_features, generator=generator(4))
    dense = dequantize_w8(weight, scale, None, zero)
    for rows in ASYMMETRIC_ROWS:
        x = torch.randn(rows, in_features, generator=generator(rows)).to(dtype)
        with_bias = bias.to(dtype) if rows % 2 else None
        out = cpu_w8_linear(x, weight, scale, None, with_bias, zero=zero)
        assert_matches(out, quantized_linear_reference(x, dense, with_bias), rows, many_rows=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features", [16, 4])
def test_every_int8_code_less_its_zero_point_decodes_exactly(dtype, out_features):
    """One-hot rows of x pick single weights: (code - zero) * scale for all 256 codes and
    zero points at both ends of int8, exactly, on every path."""
    codes = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
    in_features = 256 // out_features
    codes = codes[torch.randperm(256, generator=generator(5))].reshape(out_features, in_features)
    scale = torch.rand(out_features, 1, generator=generator(1)) + 0.5
    zero = torch.randint(-128, 128, (out_features, 1), generator=generator(2)).float()
    zero[0], zero[-1] = -128.0, 127.0
    expected = dequantize_w8(codes, scale, None, zero)
    for rows in (list(range(in_features)), list(range(0, in_features, 9))[:8], [7]):
        out = cpu_w8_linear(torch.eye(in_features, dtype=dtype)[rows], codes, scale, zero=zero)
        assert torch.equal(out, expected.t()[rows].to(dtype))


def test_asymmetric_bfloat16_takes_the_widening_kernel(monkeypatch):
    """cpu_quant_bf16.c's dot products take no zero points: an asymmetric weight's
    bfloat16 x never reaches them (as on an AVX512_BF16 host, where they are built)."""
    class NoZeroPoints:
        def __getattr__(self, name):
            raise AssertionError(f"the dot-product library's {name} was called with zero points")

    monkeypatch.setattr(cpu_quant, "_bf16_dot_library", lambda: NoZeroPoints())
    weight, scale = w8_weight(torch.int8, 24, 40), torch.rand(24, 1, generator=generator(2)) * 0.01
    zero = torch.randint(-128, 128, (24, 1), generator=generator(3)).float()
    dense = dequantize_w8(weight, scale, None, zero)
    for rows in (1, 8, 40):
        x = torch.randn(rows, 40, generator=generator(rows)).bfloat16()
        out = cpu_w8_linear(x, weight, scale, zero=zero)
        assert_matches(out, quantized_linear_reference(x, dense), rows, many_rows=0)
    call = cpu_quant.w8_decode_call(weight, scale, None, None, zero)
    assert call is not None and call.widens
    x = torch.randn(3, 40, generator=generator(9)).bfloat16()
    assert_matches(call(x), quantized_linear_reference(x, dense), 3, many_rows=0)


@pytest.mark.parametrize("zero_kind", ["tensor", "channel"])
def test_asymmetric_prefill_fills_packed_panels_with_its_zero_points(zero_kind, monkeypatch):
    """Where oneDNN's packed panels are taken (float32 x, PACKED_MIN_ROWS rows or more),
    an asymmetric weight's panels are filled with its zero points (PackedPanel.fill_w8)."""
    if not cpu_quant_panel.packed_panels_available(torch.float32):
        pytest.skip("packed panels are not taken for float32 x on this build")
    filled = []
    fill = cpu_quant_panel.PackedPanel.fill_w8

    def spied(self, *args, zero=None, **kwargs):
        filled.append(zero)
        return fill(self, *args, zero=zero, **kwargs)

    monkeypatch.setattr(cpu_quant_panel.PackedPanel, "fill_w8", spied)
    weight = w8_weight(torch.int8, 96, 256)
    shape = (1, 1) if zero_kind == "tensor" else (96, 1)
    scale = torch.rand(shape, generator=generator(2)) * 0.01
    zero = torch.randint(-128, 128, shape, generator=generator(3)).float()
    x = torch.randn(PACKED_MIN_ROWS + 44, 256, generator=generator(4))
    out = cpu_w8_linear(x, weight, scale, zero=zero)
    assert filled and all(value is not None and torch.equal(value.float(), zero) for value in filled)
    assert_matches(out, quantized_linear_reference(x, dequantize_w8(weight, scale, None, zero)), x.shape[0])


def test_zero_points_must_be_int8_integers_of_the_scales_shape():
    weight, scale = w8_weight(torch.int8, 8, 32), torch.ones(8, 1)
    x = torch.randn(2, 32)
    with pytest.raises(AssertionError, match="zero points"):
        cpu_w8_linear(x, weight, scale, zero=torch.zeros(1, 1))
    with pytest.raises(AssertionError, match="integers"):
        cpu_w8_linear(x, weight, scale, zero=torch.full((8, 1), 0.5))
    with pytest.raises(AssertionError, match="integers"):
        cpu_w8_linear(x, weight, scale, zero=torch.full((8, 1), 200.0))
    with pytest.raises(AssertionError, match="zero points on"):
        cpu_w8_linear(x, weight.view(torch.float8_e4m3fn), scale, zero=torch.zeros(8, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128, 18])  # 18: no whole vector run in a group
@pytest.mark.parametrize("with_zeros", [False, True], ids=["symmetric", "zeros"])
@pytest.mark.parametrize("out_features", [256, 101])
def test_w4_linear(dtype, group_size, with_zeros, out_features):
    assert cpu_quant_available(dtype)
    in_features = group_size * 6
    packed = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=generator(1))
    groups = (out_features, in_features // group_size)
    scales = torch.rand(groups, generator=generator(2)) * 0.05 + 0.005
    zeros = torch.randint(0, 16, groups, generator=generator(3)).float() if with_zeros else None
    bias = torch.randn(out_features, generator=generator(4))
    dense = dequantize_w4(packed, scales, zeros, group_size)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=generator(rows)).to(dtype)
        with_bias = bias.to(dtype) if rows % 2 else None
        out = cpu_w4_linear(x, packed, scales, zeros, group_size, with_bias)
        many_rows = TILE_MAX_ROWS if group_size % 32 == 0 else 0
        assert_matches(out, quantized_linear_reference(x, dense, with_bias), rows, many_rows)


@pytest.mark.parametrize("rows", [1, 300])
def test_w4_act_order_permutes_the_input(rows):
    in_features, group_size = 128, 32
    packed = torch.randint(0, 256, (48, in_features // 2), dtype=torch.uint8, generator=generator(1))
    scales = torch.rand(48, in_features // group_size, generator=generator(2)) * 0.05
    perm = torch.randperm(in_features, generator=generator(3))
    x = torch.randn(rows, in_features, generator=generator(4))
    expected = quantized_linear_reference(x, dequantize_w4(packed, scales, None, group_size), input_perm=perm)
    assert_matches(cpu_w4_linear(x, packed, scales, None, group_size, input_perm=perm), expected, rows)


@pytest.fixture(params=[False, True], ids=["denormals", "flush_denormal"])
def flush_denormal(request):
    """Each test using it also runs with the CPU flushing subnormals (torch.set_flush_denormal)."""
    if request.param and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    yield request.param
    torch.set_flush_denormal(False)


@pytest.mark.usefixtures("flush_denormal")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("out_features", [16, 4])  # 4 rows of 64 codes: whole 64-code steps
def test_every_w8_code_decodes_exactly(weight_dtype, dtype, out_features):
    """One-hot rows of x pick single weights: every one of the 256 codes (fp8's
    subnormals, zeros of both signs, the largest magnitudes) times its scale, exactly,
    whether or not the CPU flushes subnormals (the decoding builds them from bits)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if weight_dtype == torch.float8_e4m3fn:
        codes[[0x7F, 0xFF]] = 0  # fp8's NaNs: a NaN weight makes its whole row's products NaN
    in_features = 256 // out_features
    codes = codes.view(weight_dtype).reshape(out_features, in_features)
    scale = torch.rand(out_features, 1, generator=generator(1)) + 0.5
    expected = dequantize_w8(codes, scale)
    # every path: all columns' rows, then tiles of several and of 1
    for rows in (list(range(in_features)), list(range(0, in_features, 9))[:8], [7]):
        out = cpu_w8_linear(torch.eye(in_features, dtype=dtype)[rows], codes, scale)
        assert torch.equal(out, expected.t()[rows].to(dtype))


@pytest.mark.usefixtures("flush_denormal")
def test_every_fp8_code_decodes_exactly_in_blocks_of_64_columns():
    """fp8 weights in blocks of whole 64-column runs times one row of bfloat16 x take
    cpu_quant_bf16.c's table decoding (AVX512_VBMI byte lookups): every code times its
    block's scale, exactly, each block's scale its own."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[[0x7F, 0xFF]] = 0  # fp8's NaNs
    weight = codes.reshape(2, 128).view(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, generator=generator(1)) + 0.5
    expected = dequantize_w8(weight, scale, (1, 64)).t().to(torch.bfloat16)
    for column in (0, 63, 64, 127, 5, 70):
        out = cpu_w8_linear(torch.eye(128, dtype=torch.bfloat16)[[column]], weight, scale, (1, 64))
        assert torch.equal(out, expected[[column]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 20])
def test_a_nan_fp8_weight_gives_nan(dtype, rows):
    """A NaN code makes its row's outputs NaN, and no other's: in 32-column blocks the
    many-rows kernel's last partial load of a block leaves the next block's NaN out."""
    codes = torch.zeros(4, 70, dtype=torch.uint8)
    codes[1, 3], codes[2, 40] = 0x7F, 0xFF  # both signs, in and past the first 32 columns
    codes[3, 69] = 0x7F  # in the last partial block of 32 columns
    out = cpu_w8_linear(torch.ones(rows, 70, dtype=dtype), codes.view(torch.float8_e4m3fn), torch.ones(1, 1))
    assert out.isnan().tolist() == [[False, True, True, True]] * rows
    blocks = cpu_w8_linear(torch.ones(rows, 70, dtype=dtype), codes.view(torch.float8_e4m3fn),
                           torch.ones(1, 3), block=(4, 30))
    assert blocks.isnan().tolist() == [[False, True, True, True]] * rows


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan_code"])
def test_an_fp8_decode_call_knows_whether_its_weight_holds_a_nan_code(nan):
    """A bfloat16 decode call bound to an fp8 weight without NaN codes tells cpu_quant.c's
    kernel (FP8_FINITE), which decodes without the NaN test: every other code times its
    scale, exactly; bound to a weight with a NaN code it keeps the test: that row's outputs NaN."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[[0x7F, 0xFF]] = 0
    codes = codes.reshape(4, 64)
    if nan:
        codes[2, 37] = 0xFF
    weight = codes.view(torch.float8_e4m3fn)
    scale = torch.rand(4, 1, generator=generator(1)) + 0.5
    call = cpu_quant.w8_decode_call(weight, scale, None, None)
    assert call is not None
    assert (call.weight_args[1] == cpu_quant.FP8_FINITE) == (call.widens and not nan)
    expected = dequantize_w8(weight, scale).t().to(torch.bfloat16)
    for rows in (list(range(0, 64, 9)), [7], [37, 5]):  # tiles of 4 rows and fewer
        out = call(torch.eye(64, dtype=torch.bfloat16)[rows])
        if nan:
            assert out[:, 2].isnan().all()  # NaN times 0 is NaN: the whole row's outputs
            out[:, 2] = 0
        assert torch.equal(out, expected[rows].index_fill(1, torch.tensor([2] if nan else [], dtype=torch.int64), 0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 4])
def test_an_fp8_scale_near_the_float32_limit_stays_exact(dtype, rows):
    """A scale whose multiple by 2^8 overflows float32 (the AVX2 decode tiles fold fp8's
    factor 2^8 into the scale where it stays finite) still gives code times scale."""
    codes = torch.randn(8, 48, generator=generator(1)).to(torch.float8_e4m3fn)
    scale = torch.full((8, 1), 2.0**121)
    scale[0] = 0.25  # a row whose scale folds, beside ones whose scales do not
    expected = dequantize_w8(codes, scale)
    assert expected.isfinite().all()
    out = cpu_w8_linear(torch.eye(48, dtype=dtype)[:rows], codes, scale)
    assert torch.equal(out, expected.t()[:rows].to(dtype))


def test_float16_activations():
    if not cpu_quant_available(torch.float16):
        pytest.skip("this compiler has no _Float16")
    weight, scale = w8_weight(torch.int8, 64, 96), torch.rand(64, 1, generator=generator(2)) * 0.01
    for rows in (3, 40):
        x = torch.randn(rows, 96, generator=generator(5)).half()
        expected = quantized_linear_reference(x, dequantize_w8(weight, scale))
        assert_matches(cpu_w8_linear(x, weight, scale), expected, rows)


@pytest.mark.parametrize("rows", [2, 40])
def test_strided_and_batched_inputs(rows):
    """x as a column slice of a wider matrix and as [B, T, K]: the output keeps x's leading shape."""
    weight, scale = w8_weight(torch.int8, 32, 64), torch.rand(32, 1, generator=generator(2)) * 0.01
    wide = torch.randn(rows, 100, generator=generator(6))
    x = wide[:, 10:74]
    expected = quantized_linear_reference(x, dequantize_w8(weight, scale))
    assert_matches(cpu_w8_linear(x, weight, scale), expected, rows)
    batched = cpu_w8_linear(x.reshape(2, rows // 2, 64), weight, scale)
    assert batched.shape == (2, rows // 2, 32)
    assert_matches(batched.reshape(rows, 32), expected, rows)


def test_layouts_the_kernels_do_not_take_are_refused():
    weight = w8_weight(torch.int8, 32, 64)
    x = torch.randn(2, 64)
    with pytest.raises(AssertionError, match="block scale"):
        cpu_w8_linear(x, weight, torch.ones(1, 1), block=(16, 16))
    with pytest.raises(AssertionError):
        cpu_w8_linear(x, weight, torch.ones(32, 1, dtype=torch.float64))
    with pytest.raises(AssertionError):
        cpu_w4_linear(x, torch.zeros(32, 32, dtype=torch.uint8), torch.ones(32, 3), None, 24)
    assert not cpu_quant_available(torch.float64)


def test_bf16_dot_product_kernel_builds_where_the_cpu_has_it(kernel_target):
    """bfloat16 decode shapes take cpu_quant_bf16.c where the build has AVX512_BF16 (the
    tests above then check it); the narrower targets keep the float32 kernel."""
    flags = set(cpu_signature().decode().split())
    expected = kernel_target == "native" and {"avx512_bf16", "avx512bw", "avx512vl", "avx512vbmi"} <= flags
    assert (cpu_quant._bf16_dot_library() is not None) == expected
