"""Online quantization: a 16/32-bit checkpoint's linear quantized at load
(``LLM(model, quantization="fp8" | "int8")``, vLLM's option).

Per output channel, symmetric: scale = max |w| of the row / the largest code (448 for
float8_e4m3fn, 127 for int8), codes = w / scale (rounded to nearest for int8, cast
for fp8). The weight is read from the checkpoint one tensor at a time and only its
codes and scales are kept (the W8 layout of engine/kernels/quant_reference.py).
"""

from __future__ import annotations

import torch

from .checkpoint import CheckpointTensors, QuantizedCheckpointError
from .linear import QuantizedLinear
from .scheme import QuantScheme

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0
TILE_ELEMENTS = 1 << 20  # weight elements quantized at once


def quantize_per_channel(weight: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, K] codes in float8_e4m3fn or int8, [N, 1] float32 scales) of ``weight``,
    a tile of rows at a time (the float32 temporaries stay a tile's size)."""
    rows, cols = weight.shape
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn if weights == "fp8" else torch.int8,
                        device=weight.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=weight.device)
    step = max(1, TILE_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        codes[start:start + step], scales[start:start + step] = _quantize_rows(weight[start:start + step], weights)
    return codes, scales


def _quantize_rows(weight: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.to(torch.float32, copy=True)  # divided in place below
    largest = FP8_MAX if weights == "fp8" else INT8_MAX
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / largest, torch.ones_like(amax))
    scaled = w.div_(scale)
    if weights == "fp8":
        return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    return scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_linear(tensors: CheckpointTensors, module: str, scheme: QuantScheme, shape: tuple[int, int],
                    bias_dtype: torch.dtype) -> QuantizedLinear:
    """The QuantizedLinear of the checkpoint's float linear ``module``, quantized by ``scheme``."""
    name = f"{module}.weight"
    weight = tensors.get(name, "the weight to quantize")
    if not weight.is_floating_point() or tuple(weight.shape) != shape:
        raise QuantizedCheckpointError(
            f"{name}: {weight.dtype} {list(weight.shape)} cannot be quantized online, which takes a float weight "
            f"of the model's shape {list(shape)}")
    codes, scale = quantize_per_channel(weight, scheme.weights)
    bias_name = f"{module}.bias"
    bias = tensors.get(bias_name).to(bias_dtype) if bias_name in tensors else None
    return QuantizedLinear.w8(codes, scale, None, bias)
