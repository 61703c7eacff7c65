"""QuantizedLinear: its torch path (a tile of output rows dequantized at a time) and
its dispatch compute the plain-torch reference over the dequantized weight; the load
check's reference switch is scoped."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardline.engine.kernels.cpu_quant import DECODE_MAX_ROWS, cpu_quant_available
from shardline.engine.kernels.quant_reference import dequantize_w4, dequantize_w8, quantized_linear_reference
from shardline.engine.quantization import linear as quantized
from shardline.engine.quantization.formats import pack_int4
from shardline.engine.quantization.linear import QuantizedLinear, dequantized_reference, torch_quantized_matmul


def _w8(rows: int, cols: int, block: tuple[int, int] | None, per_channel: bool, dtype: torch.dtype,
        generator: torch.Generator) -> QuantizedLinear:
    weight = (torch.randn(rows, cols, generator=generator) * 40).clamp(-127, 127).to(dtype)
    if block is not None:
        scale = torch.rand(-(-rows // block[0]), -(-cols // block[1]), generator=generator) + 0.01
    else:
        scale = torch.rand(rows if per_channel else 1, 1, generator=generator) + 0.01
    return QuantizedLinear.w8(weight, scale, block, torch.randn(rows, generator=generator))


def _w8_asymmetric(rows: int, cols: int, per_channel: bool, generator: torch.Generator) -> QuantizedLinear:
    """Asymmetric int8: codes over the whole int8 range, integer zero points far from 0."""
    weight = torch.randint(-128, 128, (rows, cols), generator=generator).to(torch.int8)
    shape = (rows if per_channel else 1, 1)
    zero = torch.randint(-120, 120, shape, generator=generator).float()
    scale = torch.rand(*shape, generator=generator) / 50 + 1e-3
    return QuantizedLinear.w8(weight, scale, None, torch.randn(rows, generator=generator), zero=zero)


def _w8_asymmetric_groups(rows: int, cols: int, group: int, generator: torch.Generator) -> QuantizedLinear:
    """Asymmetric int8 by groups (blocks of one row by a group, the last one partial):
    int8 zero points of the scale's shape."""
    weight = torch.randint(-128, 128, (rows, cols), generator=generator).to(torch.int8)
    shape = (rows, -(-cols // group))
    zero = torch.randint(-128, 128, shape, generator=generator).to(torch.int8)
    scale = torch.rand(*shape, generator=generator) / 50 + 1e-3
    return QuantizedLinear.w8(weight, scale, (1, group), torch.randn(rows, generator=generator), zero=zero)


CASES = {
    "w8_int8_per_tensor": lambda g: _w8(40, 24, None, False, torch.int8, g),
    "w8_fp8_per_channel": lambda g: _w8(40, 24, None, True, torch.float8_e4m3fn, g),
    "w8_fp8_partial_blocks": lambda g: _w8(70, 52, (16, 32), False, torch.float8_e4m3fn, g),
    "w8_int8_groups": lambda g: _w8(40, 64, (1, 16), False, torch.int8, g),  # compressed-tensors groups
    "w4_zeros_act_order": lambda g: QuantizedLinear.w4(
        pack_int4(torch.randint(0, 16, (36, 64), generator=g)), torch.rand(36, 4, generator=g) + 0.01,
        torch.randint(0, 16, (36, 4), generator=g).float(), 16, torch.randperm(64, generator=g)),
    "w8_int8_asymmetric_channel": lambda g: _w8_asymmetric(40, 67, True, g),
    "w8_int8_asymmetric_tensor": lambda g: _w8_asymmetric(40, 24, False, g),
    "w8_int8_asymmetric_groups": lambda g: _w8_asymmetric_groups(40, 67, 16, g),
    "w4_symmetric": lambda g: QuantizedLinear.w4(
        pack_int4(torch.randint(0, 16, (36, 64), generator=g)), torch.rand(36, 2, generator=g) + 0.01, None, 32),
}


def _reference(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    if layer.layout == "w8":
        assert layer.weight is not None and layer.scale is not None
        weight = dequantize_w8(layer.weight, layer.scale, layer.block, layer.zero)
    else:
        assert layer.packed is not None and layer.scales is not None
        weight = dequantize_w4(layer.packed, layer.scales, layer.zeros, layer.group_size)
    return quantized_linear_reference(x, weight, layer.bias, layer.input_perm)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tile_elements", [1, 1 << 20])
def test_torch_path_and_dispatch_match_the_reference(name, tile_elements, monkeypatch):
    monkeypatch.setattr(quantized, "TILE_ELEMENTS", tile_elements)  # one row (one block) per tile, or all
    layer = CASES[name](torch.Generator().manual_seed(0))
    assert not isinstance(layer, nn.Linear)
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(1))
    expected = _reference(layer, x)
    rows = x if layer.input_perm is None else x[:, layer.input_perm]
    torch.testing.assert_close(torch_quantized_matmul(layer, rows), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer(x.reshape(1, 5, -1)).reshape(5, -1), expected, rtol=1e-5, atol=1e-4)


def test_dequantized_reference_is_scoped():
    model = nn.Sequential(CASES["w8_fp8_per_channel"](torch.Generator().manual_seed(2)))
    with dequantized_reference(model):
        assert all(module.use_reference for module in model if isinstance(module, QuantizedLinear))
    assert not any(module.use_reference for module in model if isinstance(module, QuantizedLinear))


@pytest.mark.parametrize("name", ["w8_fp8_per_channel", "w8_fp8_partial_blocks", "w4_symmetric",
                                  "w8_int8_asymmetric_channel", "w8_int8_asymmetric_groups"])
def test_bound_decode_call_follows_the_layers_tensors(name):
    """bfloat16 decode rows take the call bound to the layer's tensors (where the build
    has the bfloat16 kernel): it gives the reference, is bound again when a tensor is
    replaced, and a deep copy binds its own tensors, not the original's."""
    layer = CASES[name](torch.Generator().manual_seed(3))
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(4)).bfloat16()

    def check(module: QuantizedLinear) -> None:
        expected = _reference(module, x).float()
        bound = 1e-3 * expected.abs().max().item()
        torch.testing.assert_close(module(x).float(), expected, rtol=8e-3, atol=bound)

    check(layer)
    assert layer(x[:0]).shape == (0, layer.out_features)  # no rows: not the decode kernel's shape
    first = layer.bound_decode
    copied = copy.deepcopy(layer)
    if layer.layout == "w8":
        assert layer.weight is not None
        layer.weight = (-layer.weight.float()).to(layer.weight.dtype)  # a new tensor
        if layer.zero is not None:
            layer.zero = layer.zero + 1  # new zero points: the bound int8 copy is stale
        assert copied.weight is not None
        copied.weight.zero_()
    else:
        assert layer.scales is not None and copied.scales is not None
        layer.scales = layer.scales * 2
        copied.scales.fill_(0.5)
    check(layer)
    check(copied)
    assert first is None or layer.bound_decode is not first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_asymmetric_int8_subtracts_its_zero_points_on_every_row_count(dtype):
    """(code - zero point) * scale per element, against the product written out here
    (not through dequantize_w8), for 1..16 rows and an odd input width; bfloat16 decode
    rows bind cpu_quant.c's kernel with the zero points where it builds. Past the decode
    rows a bfloat16 x multiplies prefill panels, which may round the dequantized weight to
    bfloat16 (where oneDNN multiplies bfloat16): a relative 2^-9 per weight."""
    generator = torch.Generator().manual_seed(7)
    layer = _w8_asymmetric(48, 67, True, generator)
    assert layer.weight is not None and layer.scale is not None and layer.zero is not None and layer.bias is not None
    weight = (layer.weight.float() - layer.zero) * layer.scale
    assert not torch.equal(weight, layer.weight.float() * layer.scale)  # the zero points matter
    for rows in range(1, 17):
        x = torch.randn(rows, 67, generator=generator).to(dtype)
        expected = ((x.float() @ weight.t()) + layer.bias).to(dtype)
        if dtype == torch.float32:
            rtol, atol = 1e-5, 1e-4
        elif rows <= DECODE_MAX_ROWS:
            rtol, atol = 8e-3, 1e-4
        else:
            rtol, atol = 2e-2, 1e-2 * expected.float().abs().max().item()
        torch.testing.assert_close(layer(x), expected, rtol=rtol, atol=atol)
    if dtype == torch.bfloat16 and cpu_quant_available(torch.bfloat16):
        assert layer.bound_decode is not None and layer.bound_decode.widens


def test_zero_points_are_held_as_int8():
    """Zero points given as float32 integers are held as int8, as the C kernels read them
    (not converted on each call)."""
    layer = CASES["w8_int8_asymmetric_channel"](torch.Generator().manual_seed(8))
    assert layer.zero is not None and layer.zero.dtype == torch.int8 and layer.zero.is_contiguous()


def test_group_zero_points_take_the_tile_path_on_cuda(monkeypatch):
    """The Triton W8 kernel takes zero points per row only: QuantizedLinear's CUDA path
    (called here directly) runs a layer with group zero points through the tile path."""
    def refused(*args, **kwargs):
        raise AssertionError("group zero points handed to the Triton W8 kernel")

    monkeypatch.setattr(quantized, "triton_w8_linear", refused)
    layer = CASES["w8_int8_asymmetric_groups"](torch.Generator().manual_seed(9))
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(10))
    torch.testing.assert_close(quantized.cuda_kernel_matmul(layer, x), _reference(layer, x), rtol=1e-5, atol=1e-4)
