"""Activations quantized as a W8A8 checkpoint's own forward quantizes them.

compressed-tensors runs a linear whose scheme has ``input_activations`` (dynamic,
symmetric, per token) by fake-quantizing its input first: per token, scale = max|x| /
(half the code range), x / scale clamped to the range and rounded to the code type,
then multiplied back by the scale, all in x's dtype; the linear then runs on that
input. These functions compute exactly that in plain torch: they are the reference of
the int8 kernel (kernels/cpu_quant_int8.py) and what every other path multiplies.

Invariants:
- ``InputQuantization`` "int8": codes round half to even into [-128, 127] with
  scale = max|x| / 127.5; "fp8": float8_e4m3fn codes with scale = max|x| / 448. A zero
  scale becomes the dtype's epsilon (the codes are then all 0), as in compressed-tensors.
- The scale and the dequantized x are of x's dtype (a 16-bit x rounds them as torch does).
"""

from __future__ import annotations

from typing import Literal

import torch

from ..kernels.cpu_quant_int8 import cpu_int8_fake_quantize, cpu_int8_fake_quantize_available
from ..kernels.quant_reference import dequantize_w8, quantized_linear_reference

InputQuantization = Literal["none", "int8", "fp8"]
# Half of each code type's range [q_min, q_max]: compressed-tensors' symmetric divisor.
_HALF_RANGE = {"int8": 127.5, "fp8": 448.0}
_BOUNDS = {"int8": (-128.0, 127.0), "fp8": (-448.0, 448.0)}


def token_scales(x: torch.Tensor, kind: InputQuantization) -> torch.Tensor:
    """x [..., K] -> [..., 1] per-token scales of x's dtype for ``kind`` codes."""
    return scales_from_absmax(x.abs().amax(dim=-1, keepdim=True), kind)


def scales_from_absmax(amax: torch.Tensor, kind: InputQuantization) -> torch.Tensor:
    """Per-token scales (amax's dtype and shape) from each token's max|x| ``amax``: a
    tensor-parallel row share passes the max over ranks of each rank's max, which is
    the whole row's."""
    scales = amax / torch.tensor(_HALF_RANGE[kind], dtype=amax.dtype)
    return torch.where(scales == 0, torch.tensor(torch.finfo(amax.dtype).eps, dtype=amax.dtype), scales)


def int8_token_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (int8 codes [..., K], scales [..., 1] of x's dtype)."""
    scales = token_scales(x, "int8")
    low, high = _BOUNDS["int8"]
    return torch.round(torch.clamp(x / scales, low, high)).to(torch.int8), scales


def fake_quantize_inputs(x: torch.Tensor, kind: InputQuantization) -> torch.Tensor:
    """x [..., K] quantized per token to ``kind`` codes and multiplied back (x's dtype)."""
    if kind == "none":
        return x
    return fake_quantize_with_scales(x, token_scales(x, kind), kind)


def fake_quantize_inputs_cpu(x: torch.Tensor, kind: InputQuantization) -> torch.Tensor:
    """``fake_quantize_inputs`` of x [M, K], bit for bit, by one C pass per row
    (kernels/cpu_quant_int8.py) where it takes x (int8 codes, a CPU x of float32 or
    bfloat16 with contiguous rows): a decode step's torch ops would cost more than its
    quantized linear's product."""
    if (kind == "int8" and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1
            and cpu_int8_fake_quantize_available(x.dtype)):
        return cpu_int8_fake_quantize(x)
    return fake_quantize_inputs(x, kind)


def fake_quantize_with_scales(x: torch.Tensor, scales: torch.Tensor, kind: InputQuantization) -> torch.Tensor:
    """x [..., K] quantized to ``kind`` codes with the given per-token ``scales`` [..., 1]
    (x's dtype) and multiplied back: ``fake_quantize_inputs`` with its scales given."""
    low, high = _BOUNDS[kind]
    if kind == "int8":
        return torch.round(torch.clamp(x / scales, low, high)).to(torch.int8).to(x.dtype) * scales
    return torch.clamp(x / scales, low, high).to(torch.float8_e4m3fn).to(x.dtype) * scales


def w8a8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   kind: InputQuantization = "int8") -> torch.Tensor:
    """x [M, K] fake-quantized per token, times the dequantized W8 ``weight`` [N, K]
    (``scale`` [1, 1] or [N, 1]): the float32 product rounded to x's dtype once."""
    return quantized_linear_reference(fake_quantize_inputs(x, kind), dequantize_w8(weight, scale), bias)
