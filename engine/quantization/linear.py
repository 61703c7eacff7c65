"""QuantizedLinear: a linear layer whose weight stays in the W8 or W4 layout of
engine/kernels/quant_reference.py, multiplied by the kernel for its device.

Not an nn.Linear subclass: the CPU step's packing (engine/cpu/linear.py) replaces
nn.Linear only, so it leaves these alone, and nothing reads a float ``weight`` it
does not hold.

Invariants:
- The module holds its weight quantized (W8: ``weight`` float8_e4m3fn or int8 [N, K]
  and a float32 ``scale``; W4: ``packed`` uint8 [N, K // 2], float32 ``scales`` and
  ``zeros`` [N, K // group_size]); no float copy of the weight is kept: the torch path
  dequantizes a tile of output rows at a time.
- Every path computes ``quantized_linear_reference`` over the dequantized weight (the
  float32 product rounded to x's dtype once), within float32 rounding, except that the
  CPU kernels' prefill panels round the dequantized weight to a 16-bit x's dtype once;
  the load check runs the model once with ``use_reference`` set to compare against it.
- An act-order ``input_perm`` reorders x's columns before any kernel runs.
- An asymmetric int8 W8 layer (``zero`` set: int8 zero points of the scale's shape, per
  tensor, output channel or block) runs every path but the ones that take no zero
  point: cpu_quant.c's kernels take them (bfloat16 x widened by them even where
  cpu_quant_bf16.c's dot products would run), the W8A8 integer kernel does not (x is
  fake-quantized instead), nor does the Triton W8 kernel take them per block (such a
  layer runs the torch tile path on CUDA).
- ``input_quantization`` other than "none" (a compressed-tensors W8A8 checkpoint): every
  path, the reference included, multiplies x as the checkpoint's own forward quantizes
  it per token (engine/quantization/activations.py); the int8 one runs as integer
  products on CPUs with AVX512_VNNI (kernels/cpu_quant_int8.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from ..kernels.cpu_quant import (
    DECODE_MAX_ROWS,
    DecodeCall,
    cpu_quant_available,
    cpu_w4_linear,
    cpu_w8_linear,
    w4_decode_call,
    w4_layout_supported,
    w8_decode_call,
)
from ..kernels.cpu_quant_int8 import MAX_IN_FEATURES, cpu_w8a8_available, cpu_w8a8_linear
from ..kernels.fp8_w8a8 import fp8_w8a8_linear, fp8_w8a8_supported
from ..kernels.quant_linear import triton_w4_linear, triton_w8_linear
from ..kernels.quant_reference import dequantize_w4, dequantize_w8, quantized_linear_reference
from .activations import InputQuantization, fake_quantize_inputs, fake_quantize_inputs_cpu

# Float32 elements of dequantized weight the torch path holds at once (a tile of rows).
TILE_ELEMENTS = 1 << 20


class QuantizedLinear(nn.Module):
    """y = x @ w.T + bias with w kept quantized (see the module docstring); built by
    ``w8`` or ``w4``. ``activations`` "dynamic": a W8A8 kernel may quantize x per
    token where the device has FP8 tensor cores. ``input_quantization``: how the
    checkpoint's own forward quantizes x (see the module docstring)."""

    weight: torch.Tensor | None
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    packed: torch.Tensor | None
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    input_perm: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, layout: Literal["w8", "w4"],
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        self.block: tuple[int, int] | None = None
        self.group_size = 0
        self.activations: Literal["none", "dynamic", "static"] = "none"
        self.input_quantization: InputQuantization = "none"
        self.use_reference = False
        # The CPU path (engine/cpu/paths.py's quant_kernels): the C kernels where they
        # build and take the layout, else the torch tile path.
        self.cpu_kernels = True
        # With them, W8A8 int8 through integer products (paths.py's quant_int8_kernel).
        self.int8_kernel = True
        # And one row of bfloat16 x times int8 codes through the digit products where they
        # build (paths.py's quant_digits_kernel), else the bfloat16 tiles.
        self.digit_tiles = True
        # The bfloat16 decode kernel's call bound to this layer's tensors (decode_call).
        self.bound_decode: DecodeCall | None = None
        for name in ("weight", "scale", "zero", "packed", "scales", "zeros", "input_perm"):
            self.register_buffer(name, None)
        self.register_buffer("bias", bias)

    @classmethod
    def w8(cls, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
           bias: torch.Tensor | None = None, input_perm: torch.Tensor | None = None,
           zero: torch.Tensor | None = None) -> QuantizedLinear:
        """A W8 linear: ``weight`` [N, K] fp8/int8, ``scale`` float32 [1, 1], [N, 1] or per
        block; ``input_perm`` for act-order columns stored by group (8-bit GPTQ);
        ``zero`` the zero points of an asymmetric int8 weight, shaped as its scale
        (integers in int8's range, held as int8 as the C kernels read them)."""
        rows, cols = weight.shape
        assert zero is None or (weight.dtype == torch.int8 and zero.shape == scale.shape), (
            weight.dtype, None if zero is None else zero.shape, scale.shape)
        layer = cls(cols, rows, "w8", bias)
        layer.weight, layer.scale, layer.block = weight.contiguous(), scale.float().contiguous(), block
        layer.zero = None if zero is None else _int8_zero_points(zero)
        layer.input_perm = input_perm
        return layer

    @classmethod
    def w4(cls, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
           input_perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> QuantizedLinear:
        """A W4 linear: ``packed`` [N, K // 2] uint8, ``scales``/``zeros`` [N, K // group_size]."""
        rows, half = packed.shape
        layer = cls(2 * half, rows, "w4", bias)
        # Contiguous, as the kernels read them (a checkpoint's conversion may leave views).
        layer.packed, layer.scales, layer.group_size = packed.contiguous(), scales.float().contiguous(), group_size
        layer.zeros = None if zeros is None else zeros.float().contiguous()
        layer.input_perm = input_perm
        return layer

    def extra_repr(self) -> str:
        stored = self.weight if self.layout == "w8" else self.packed
        detail = f"block={self.block}" if self.layout == "w8" else f"group_size={self.group_size}"
        dtype = stored.dtype if stored is not None else None
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.layout} {dtype}, "
                f"{detail}, bias={self.bias is not None}")

    def dequantized_rows(self, start: int, end: int) -> torch.Tensor:
        """The float32 weight rows [start, end) ([end - start, K], in stored column order)."""
        if self.layout == "w8":
            assert self.weight is not None and self.scale is not None
            zero = None if self.zero is None else self._scale_rows(start, end, self.zero)
            return dequantize_w8(self.weight[start:end], self._scale_rows(start, end), self.block, zero)
        assert self.packed is not None and self.scales is not None
        zeros = None if self.zeros is None else self.zeros[start:end]
        return dequantize_w4(self.packed[start:end], self.scales[start:end], zeros, self.group_size)

    def _scale_rows(self, start: int, end: int, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of ``scale`` (the layer's scale by default, or its zero points, of
        the same shape) for output rows [start, end)."""
        scale = self.scale if scale is None else scale
        assert scale is not None
        if self.block is not None:
            rows = self.block[0]
            assert start % rows == 0, (start, rows)
            return scale[start // rows:-(-end // rows)]
        return scale if scale.shape[0] == 1 else scale[start:end]

    def tile_rows(self) -> int:
        """Output rows the torch path dequantizes at once: a multiple of the block's rows."""
        step = self.block[0] if self.block is not None else 1
        rows = max(step, TILE_ELEMENTS // max(self.in_features, 1) // step * step)
        return min(rows, -(-self.out_features // step) * step)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        # A decoder layer's rows: no reshapes there and back.
        if self.input_perm is None and x.dim() == 2 and x.shape[1] == self.in_features:
            return quantized_matmul(self, x)
        rows = x.reshape(-1, self.in_features)
        if self.input_perm is not None:
            rows = rows[:, self.input_perm]
        return quantized_matmul(self, rows).reshape(*x.shape[:-1], self.out_features)


def quantized_matmul(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (act-order permutation applied) times ``layer``'s weight, plus its bias:
    [M, N] in x's dtype, by the kernel for x's device. The one dispatch: each kernel
    family is wired here in one line where it runs."""
    if layer.use_reference:
        x = fake_quantize_inputs(x, layer.input_quantization)
        return quantized_linear_reference(x, layer.dequantized_rows(0, layer.out_features), layer.bias)
    if x.is_cuda:  # Tensor.is_cuda and is_cpu: reading device.type builds a device object each call
        return cuda_kernel_matmul(layer, x)
    if layer.input_quantization != "none":
        if x.is_cpu and layer.cpu_kernels and layer.int8_kernel and int8_kernel_takes(layer, x):
            assert layer.weight is not None and layer.scale is not None
            return cpu_w8a8_linear(x, layer.weight, layer.scale, layer.bias)
        quantize = fake_quantize_inputs_cpu if layer.cpu_kernels else fake_quantize_inputs
        x = quantize(x, layer.input_quantization)
    call = decode_call(layer, x)
    if call is not None:
        return call(x)
    if x.is_cpu and layer.cpu_kernels and cpu_quant_available(x.dtype) and cpu_kernel_takes(layer):
        return cpu_kernel_matmul(layer, x)
    return torch_quantized_matmul(layer, x)


def int8_kernel_takes(layer: QuantizedLinear, x: torch.Tensor) -> bool:
    """Whether the W8A8 int8 kernel (integer products, AVX512_VNNI) runs this layer on x:
    int8 inputs and symmetric int8 weights with a per-tensor or per-channel scale, x
    float32 or bfloat16."""
    return (layer.input_quantization == "int8" and layer.layout == "w8" and layer.block is None
            and layer.zero is None and layer.weight is not None and layer.weight.dtype == torch.int8
            and layer.in_features <= MAX_IN_FEATURES and cpu_w8a8_available(x.dtype))


def cuda_kernel_matmul(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """The Triton kernels: FP8 W8A8 (activations quantized per token) for an FP8 layer
    whose checkpoint quantizes activations, on GPUs with FP8 tensor cores; weight-only
    W8A16 / W4A16 otherwise, on x quantized as the checkpoint's forward quantizes it."""
    if layer.layout == "w8":
        assert layer.weight is not None and layer.scale is not None
        if (layer.activations != "none" and layer.weight.dtype == torch.float8_e4m3fn
                and fp8_w8a8_supported(x.device)):
            return fp8_w8a8_linear(x, layer.weight, layer.scale, layer.block, layer.bias)
        x = fake_quantize_inputs(x, layer.input_quantization)
        if layer.zero is not None and layer.block is not None:  # the Triton W8 kernel's zero points: per row
            return torch_quantized_matmul(layer, x)
        zero = None if layer.zero is None else layer.zero.float()
        return triton_w8_linear(x, layer.weight, layer.scale, layer.block, layer.bias, zero=zero)
    assert layer.packed is not None and layer.scales is not None
    x = fake_quantize_inputs(x, layer.input_quantization)
    return triton_w4_linear(x, layer.packed, layer.scales, layer.zeros, layer.group_size, layer.bias)


def cpu_kernel_takes(layer: QuantizedLinear) -> bool:
    """Whether the CPU C kernels (kernels/cpu_quant.py) take this layer's layout."""
    return layer.layout == "w8" or w4_layout_supported(layer.in_features, layer.group_size)


def cpu_kernel_matmul(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """The CPU C kernels: the decode shapes stream the quantized weight, dequantizing in
    registers; the prefill shapes multiply panels of it dequantized to x's dtype."""
    if layer.layout == "w8":
        assert layer.weight is not None and layer.scale is not None
        return cpu_w8_linear(x, layer.weight, layer.scale, layer.block, layer.bias, zero=layer.zero,
                             digits=layer.digit_tiles)
    assert layer.packed is not None and layer.scales is not None
    return cpu_w4_linear(x, layer.packed, layer.scales, layer.zeros, layer.group_size, layer.bias)


def decode_call(layer: QuantizedLinear, x: torch.Tensor) -> DecodeCall | None:
    """The layer's bfloat16 decode-kernel call where it runs x (a CPU decode shape of
    bfloat16 rows, already quantized as the layer's input_quantization says, the C
    kernels chosen): bound on first use and again whenever the layer's tensors were
    replaced; None where it does not run x."""
    if not (x.dtype == torch.bfloat16 and 0 < x.shape[0] <= DECODE_MAX_ROWS and x.is_cpu and x.stride(-1) == 1
            and layer.cpu_kernels):
        return None
    buffers = layer._buffers  # read directly: a decode step asks this for every linear
    if layer.layout == "w8":  # the flag by identity too: True and False are single objects
        source = (buffers["weight"], buffers["scale"], buffers["zero"], buffers["bias"], layer.digit_tiles)
    else:
        source = (buffers["packed"], buffers["scales"], buffers["zeros"], buffers["bias"])
    call = layer.bound_decode
    if call is None or not call.binds(source):
        if layer.layout == "w8":
            assert layer.weight is not None and layer.scale is not None
            call = w8_decode_call(layer.weight, layer.scale, layer.block, layer.bias, layer.zero, layer.digit_tiles)
        else:
            assert layer.packed is not None and layer.scales is not None
            call = w4_decode_call(layer.packed, layer.scales, layer.zeros, layer.group_size, layer.bias)
        layer.bound_decode = call
    return call


def torch_quantized_matmul(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """The torch path: a tile of output rows dequantized at a time, multiplied in float32."""
    # x: [M, K], out: [M, N] float32 until the one rounding to x's dtype
    x32 = x.float()
    out = torch.empty(x.shape[0], layer.out_features, dtype=torch.float32, device=x.device)
    step = layer.tile_rows()
    for start in range(0, layer.out_features, step):
        end = min(start + step, layer.out_features)
        out[:, start:end] = x32 @ layer.dequantized_rows(start, end).t()
    if layer.bias is not None:
        out += layer.bias.float()
    return out.to(x.dtype)


def _int8_zero_points(zero: torch.Tensor) -> torch.Tensor:
    """Zero points (int8, or integers in int8's range of another dtype) as int8, contiguous."""
    codes = zero.detach().to(torch.int8).contiguous()
    assert zero.dtype == torch.int8 or torch.equal(codes.to(zero.dtype), zero), "zero points are int8 integers"
    return codes


def quantized_linears(model: nn.Module) -> Iterator[tuple[str, QuantizedLinear]]:
    """(name, module) of every QuantizedLinear in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            yield name, module


@contextmanager
def dequantized_reference(model: nn.Module) -> Iterator[None]:
    """Within: every quantized module of ``model`` computes through the plain-torch
    reference (a QuantizedLinear's whole weight dequantized per call, dropped after;
    quantized experts and their MXFP4 projections likewise, no fused kernel), which is
    the model's forward with the weights dequantized; the load check's reference. A
    quantized module is one with a boolean ``use_reference`` attribute."""
    layers: list[Any] = [module for module in model.modules()
                         if isinstance(getattr(module, "use_reference", None), bool)]
    for module in layers:
        module.use_reference = True
    try:
        yield
    finally:
        for module in layers:
            module.use_reference = False


# How far a layer whose input is quantized may move its output from the reference,
# relative to its largest value. FP8 W8A8 on GPUs with FP8 tensor cores rounds each
# input element to 3 mantissa bits; where the checkpoint's forward quantizes inputs
# (input_quantization), a last-bit difference upstream (the paged attention's sums
# against the reference's) can move an element across a rounding boundary: one code
# step of its token's scale.
ACTIVATION_QUANTIZED_TOLERANCE = 0.1


def quantized_tolerance(model: nn.Module) -> float:
    """The load check's tolerance the model's quantized linears need beyond their
    dtype's: ACTIVATION_QUANTIZED_TOLERANCE where a W8A8 layer runs on CUDA or any layer
    quantizes its input, else 0 (every weight-only path computes the reference's float32
    product)."""
    needs = any(layer.input_quantization != "none" or (
        layer.activations != "none" and layer.layout == "w8" and layer.weight is not None
        and layer.weight.device.type == "cuda") for _, layer in quantized_linears(model))
    return ACTIVATION_QUANTIZED_TOLERANCE if needs else 0.0
