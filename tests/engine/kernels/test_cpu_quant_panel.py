"""Prefill panels dequantized straight into oneDNN's blocked layout (cpu_quant_panel.c):
the packed buffer must hold exactly what oneDNN's own packing of the dequantized weight
(quant_reference, rounded to x's dtype once) holds, byte for byte, on each build target
(vector tiles: float32 and bfloat16 on AVX-512 builds, float32 on AVX2 ones; the others
and ragged edges element by element); and the probed layout must be the one oneDNN
uses."""

import shutil

import pytest
import torch

from shardline.engine.kernels import cpu_quant, cpu_quant_panel, native
from shardline.engine.kernels.cpu_quant import (
    PACKED_MIN_ROWS,
    TILE_MAX_ROWS,
    cpu_w4_linear,
    cpu_w8_linear,
    panel_dtype,
    w8_blocks,
)
from shardline.engine.kernels.cpu_quant_panel import PackedPanel, find_layout, packed_panels_available
from shardline.engine.kernels.onednn_rows import SMALL_ROWS, row_bucket, row_parts
from shardline.engine.kernels.quant_reference import dequantize_w4, dequantize_w8, quantized_linear_reference

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="no C compiler: no packed panels"),
              pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")]

DTYPES = [torch.float32, torch.bfloat16]
# (panel rows, K): whole tiles; ragged rows and K (edges element by element, padded columns).
SHAPES = [(128, 256), (70, 200), (37, 96)]
# Scale blocks (rows, columns) by name: 128 and 32 columns suit every build's vector
# runs; 16 only float32's (bfloat16 runs are 32 columns); 24 none (element by element).
W8_BLOCKS = {"block128": (128, 128), "block_64x32": (64, 32), "block_16x16": (16, 16), "block_32x24": (32, 24)}


def dtype_packs(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_bytes(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's own packing of ``weight`` (the hint the panels use), as raw bytes."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1024)
    return cpu_quant_panel._buffer(packed, torch.uint8).clone()


def panel_for(rows: int, cols: int, dtype: torch.dtype) -> PackedPanel:
    if not dtype_packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    layout = find_layout(rows, cols, dtype)
    assert layout is not None, f"oneDNN's layout for [{rows}, {cols}] {dtype} is not a blocked one"
    return PackedPanel(rows, cols, dtype, layout)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.usefixtures("kernel_target")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("scale_kind", ["tensor", "channel", "tiny_channel", *W8_BLOCKS])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_w8_panel_is_onednns_packing_of_the_dequantized_weight(dtype, weight_dtype, scale_kind, rows, cols):
    total_rows, n0 = rows + 64, 64  # a panel starting past the weight's first rows (and block rows)
    codes = torch.randn(total_rows, cols, generator=generator(1)) * 60
    weight = (codes.round().clamp(-127, 127).to(torch.int8) if weight_dtype == torch.int8
              else codes.to(torch.float8_e4m3fn))  # every fp8 exponent, subnormals included
    block = W8_BLOCKS.get(scale_kind)
    scale = w8_scale(scale_kind, total_rows, cols, block)
    panel = panel_for(rows, cols, dtype)
    panel.fill_w8(weight, scale, w8_blocks(weight, scale, block), n0, threads=2)
    dequantized = dequantize_w8(weight, scale, block)[n0:n0 + rows].to(dtype)
    assert torch.equal(cpu_quant_panel._buffer(panel.packed, torch.uint8), onednn_bytes(dequantized))


def w8_scale(scale_kind: str, rows: int, cols: int, block: tuple[int, int] | None) -> torch.Tensor:
    """A W8 scale of ``scale_kind``: per tensor, per channel (tiny_channel: rows on both
    sides of where values turn subnormal) or per ``block``."""
    shape = {"tensor": (1, 1), "channel": (rows, 1), "tiny_channel": (rows, 1)}.get(
        scale_kind, (-(-rows // (block or (1, 1))[0]), -(-cols // (block or (1, 1))[1])))
    if scale_kind == "tiny_channel":
        return torch.rand(shape, generator=generator(2)) * 2.0 ** -112
    return torch.rand(shape, generator=generator(2)) * 1e-2 + 1e-3


@pytest.mark.usefixtures("kernel_target")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_kind", ["tensor", "channel"])  # asymmetric int8's scales
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_w8_zero_points_are_subtracted_from_int8_codes(dtype, scale_kind, rows, cols):
    """Asymmetric int8: w = (code - zero[row]) * scale, over every code and zero point
    (differences of -255 .. 255, exact before the scale); ragged rows and K take the
    element-by-element edges."""
    total_rows, n0 = rows + 64, 64
    weight = torch.randint(-128, 128, (total_rows, cols), dtype=torch.int8, generator=generator(12))
    zero = torch.randint(-128, 128, (total_rows,), dtype=torch.int8, generator=generator(13))
    zero[n0:n0 + 2] = torch.tensor([-128, 127], dtype=torch.int8)
    scale = w8_scale(scale_kind, total_rows, cols, None)
    panel = panel_for(rows, cols, dtype)
    panel.fill_w8(weight, scale, w8_blocks(weight, scale, None), n0, threads=2, zero=zero)
    dequantized = dequantize_w8(weight, scale, None, zero.view(-1, 1))[n0:n0 + rows]
    assert dequantized[:2].abs().amax(1).gt(0).all()
    assert torch.equal(cpu_quant_panel._buffer(panel.packed, torch.uint8), onednn_bytes(dequantized.to(dtype)))
    if scale_kind == "tensor":  # one zero point for every row
        panel.fill_w8(weight, scale, w8_blocks(weight, scale, None), n0, threads=2, zero=zero[n0:n0 + 1])
        expected = dequantize_w8(weight, scale, None, zero[n0:n0 + 1].view(1, 1))[n0:n0 + rows].to(dtype)
        assert torch.equal(cpu_quant_panel._buffer(panel.packed, torch.uint8), onednn_bytes(expected))
    symmetric = panel_for(rows, cols, dtype)  # no zero points: the codes as they are
    symmetric.fill_w8(weight, scale, w8_blocks(weight, scale, None), n0, threads=2)
    plain = dequantize_w8(weight, scale)[n0:n0 + rows].to(dtype)
    assert torch.equal(cpu_quant_panel._buffer(symmetric.packed, torch.uint8), onednn_bytes(plain))


def test_zero_points_are_refused_for_fp8_weights():
    weight = torch.zeros(64, 64).to(torch.float8_e4m3fn)
    panel = panel_for(64, 64, torch.float32)
    with pytest.raises(AssertionError, match="zero points are for int8"):
        panel.fill_w8(weight, torch.ones(1, 1), (64, 64), 0, threads=1, zero=torch.zeros(64, dtype=torch.int8))


@pytest.mark.usefixtures("kernel_target")
def test_the_build_reports_the_vector_tiles_its_instruction_set_has():
    """float32 tiles from AVX2 up, bfloat16 ones on AVX-512; packed panels are offered
    for exactly the dtypes with tiles (where oneDNN packs them)."""
    library = cpu_quant_panel._LIBRARY.load()
    assert library is not None
    isa = native.built_vector_isa()
    assert library.panel_vector_tiles() == {"avx512": 3, "avx2": 1}.get(isa or "", 0), isa
    for dtype, bit in ((torch.float32, 1), (torch.bfloat16, 2)):
        assert packed_panels_available(dtype) == (dtype_packs(dtype) and bool(library.panel_vector_tiles() & bit))


@pytest.mark.usefixtures("kernel_target")
@pytest.mark.parametrize("dtype", DTYPES)
# 16: whole runs of float32 tiles only; 18: runs cross groups, element by element
@pytest.mark.parametrize("group_size", [32, 128, 16, 18])
@pytest.mark.parametrize("with_zeros", [False, True], ids=["symmetric", "zeros"])
def test_w4_panel_is_onednns_packing_of_the_dequantized_weight(dtype, group_size, with_zeros):
    rows, cols, n0 = 80, 2 * 18 * 16 if group_size == 18 else 256, 16  # 80: a tile past the 64-row block
    total_rows = rows + n0
    packed = torch.randint(0, 256, (total_rows, cols // 2), dtype=torch.uint8, generator=generator(3))
    scales = torch.rand(total_rows, cols // group_size, generator=generator(4)) * 1e-2 + 1e-3
    zeros = torch.randint(0, 16, scales.shape, generator=generator(5)).float() if with_zeros else None
    panel = panel_for(rows, cols, dtype)
    panel.fill_w4(packed, scales, zeros, group_size, n0, threads=2)
    dequantized = dequantize_w4(packed, scales, zeros, group_size)[n0:n0 + rows].to(dtype)
    assert torch.equal(cpu_quant_panel._buffer(panel.packed, torch.uint8), onednn_bytes(dequantized))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_fp8_codes_stay_nan_in_the_panel(dtype):
    weight = torch.full((64, 64), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 0x7f: NaN
    weight[::2] = torch.tensor(1.0).to(torch.float8_e4m3fn)  # even output rows finite
    panel = panel_for(64, 64, dtype)
    panel.fill_w8(weight, torch.ones(1, 1), (64, 64), 0, threads=1)
    out = panel.matmul(torch.ones(3, 64, dtype=dtype), None)
    assert out[:, 1::2].isnan().all() and not out[:, ::2].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [PACKED_MIN_ROWS, 300])
def test_prefill_rows_take_the_packed_panels_and_match_the_reference(dtype, rows):
    """Through the launchers (cpu_quant.py): a weight of several panels, a bias, rows
    oneDNN sees padded; float32: the reference's float32 product up to the order of its
    sums; bfloat16: the weight rounded to bfloat16 once (or kept float32 where the
    panels are: ``panel_dtype``), one rounding of the sum."""
    if not packed_panels_available(panel_dtype(dtype)):
        pytest.skip("no packed panels for this dtype on this build")
    if dtype == torch.bfloat16 and rows <= TILE_MAX_ROWS and cpu_quant._bf16_dot_library() is not None:
        pytest.skip("bfloat16 rows up to TILE_MAX_ROWS take the register-blocked kernel on this build")
    out_features, in_features = 4200, 512  # panels of 4096 (float32: 2048) rows and a short last one
    weight = (torch.randn(out_features, in_features, generator=generator(6)) * 40).round().clamp(-127, 127)
    weight = weight.to(torch.int8)
    scale = torch.rand(out_features, 1, generator=generator(7)) * 1e-2 + 1e-3
    bias = torch.randn(out_features, generator=generator(8))
    x = torch.randn(rows, in_features, generator=generator(9)).to(dtype)
    expected = quantized_linear_reference(x, dequantize_w8(weight, scale, None), bias)
    cpu_quant_panel.clear_packed_panels()
    out = cpu_w8_linear(x, weight, scale, None, bias)
    assert len(cpu_quant_panel._PANELS.by_shape) >= 2, "the packed panels were not used"
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 1e-2)
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol * expected.abs().max().item())
    packed = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=generator(10))
    scales = torch.rand(out_features, in_features // 128, generator=generator(11)) * 1e-2
    expected = quantized_linear_reference(x, dequantize_w4(packed, scales, None, 128), None)
    out = cpu_w4_linear(x, packed, scales, None, 128)
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [5, 260, 600])
def test_panel_rows_reach_onednn_as_the_packed_linears_do(monkeypatch, dtype, rows):
    """A panel's matmul takes kernels/onednn_rows.py's calls (past LARGE_ROWS its
    multiple of LARGE_ROWS and the rest, each padded to its bucket), so a step a few
    rows past a multiple of LARGE_ROWS pads fewer than SMALL_ROWS rows, not a whole
    LARGE_ROWS; the parts come back in order."""
    panel = panel_for(64, 64, dtype)
    weight = (torch.randn(64, 64, generator=generator(12)) * 40).round().clamp(-127, 127).to(torch.int8)
    panel.fill_w8(weight, torch.ones(1, 1), (64, 64), 0, threads=1)
    seen: list[int] = []
    rows_matmul = PackedPanel._rows_matmul
    monkeypatch.setattr(PackedPanel, "_rows_matmul",
                        lambda self, x, bias: (seen.append(x.shape[0]), rows_matmul(self, x, bias))[1])
    x = torch.randn(rows, 64, generator=generator(13)).to(dtype)
    out = panel.matmul(x, None)
    assert seen == list(row_parts(rows))
    assert sum(row_bucket(part) for part in seen) - rows < SMALL_ROWS
    expected = (x.double() @ weight.double().t()).to(dtype)
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=rtol, atol=rtol * expected.abs().max().item())


def test_the_probed_layout_is_checked_element_by_element():
    """find_layout's description reproduces oneDNN's packing of an index-coded weight."""
    for dtype in [dtype for dtype in DTYPES if dtype_packs(dtype)]:
        for rows, cols in SHAPES:
            layout = find_layout(rows, cols, dtype)
            assert layout is not None
            per_unit = 4 // torch.tensor([], dtype=dtype).element_size()
            expected = cpu_quant_panel._expected_indices(layout, rows, cols, per_unit)
            assert torch.equal(cpu_quant_panel._packed_indices(rows, cols, dtype), expected)
