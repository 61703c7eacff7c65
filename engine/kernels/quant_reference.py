"""Plain-torch references of the quantized-weight kernels: the CPU C kernels
(cpu_quant) and the Triton kernels (quant_*) are tested against these, and the load
check's dequantized reference model is built with them.

Every quantized weight the engine holds is in one of three in-memory layouts (the
checkpoint formats are converted to these at load, engine/quantization/):

- W8: ``weight`` [N, K] in torch.float8_e4m3fn or torch.int8 and a float32
  ``scale``: [1, 1] (per tensor), [N, 1] (per output channel) or [ceil(N/bn),
  ceil(K/bk)] for blocks of ``block`` = (bn, bk) (the last block of a row or column
  may be partial). w[n, k] = weight[n, k] * scale[n // bn, k // bk] (bn = N, bk = K
  per tensor; bn = 1, bk = K per channel). An asymmetric int8 weight (compressed-tensors
  ``symmetric: false``) adds an int8 ``zero`` of the scale's shape (per tensor, channel
  or block: int8 groups are blocks of one row) holding its zero points:
  w[n, k] = (weight[n, k] - zero[n // bn, k // bk]) * scale[n // bn, k // bk], the
  difference exact in float32, rounded once by the product.
- W4: ``packed`` [N, K // 2] uint8, column 2j in the low nibble of byte j and
  column 2j + 1 in the high nibble, each an unsigned 0..15; float32 ``scales`` and
  ``zeros`` [N, K // group_size] (``zeros`` None: symmetric, zero point 8).
  w[n, k] = (q[n, k] - zero[n, k // g]) * scale[n, k // g]. A GPTQ act-order
  checkpoint's columns are stored grouped (sorted by their group) with
  ``input_perm`` [K] int64, so the linear computes x[:, input_perm] @ w.T.
- MXFP4 (OCP microscaling, gpt-oss's experts): ``blocks`` [..., N, K // 32, 16]
  uint8, two FP4 (E2M1) codes per byte, the element with the lower index in the low
  nibble; ``scales`` [..., N, K // 32] uint8 E8M0 exponents: w = fp4 * 2^(scale - 127).

A quantized linear multiplies in float32 whatever the activation's dtype and rounds
its output to the activation's dtype once, as transformers' 16-bit matmuls
accumulate in float32.
"""

from __future__ import annotations

import torch

# The sixteen E2M1 values by code: sign bit 3, exponent bits 2..1, mantissa bit 0.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

W8_DTYPES = (torch.float8_e4m3fn, torch.int8)


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int],
                       block: tuple[int, int] | None) -> torch.Tensor:
    """A W8 scale (per tensor [1, 1], per channel [N, 1], or per block) broadcast to the
    weight's [N, K] in float32."""
    rows, cols = shape
    scale = scale.float()
    if block is None:
        return scale.expand(rows, cols)
    block_rows, block_cols = block
    return scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]


def dequantize_w8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                  zero: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 [N, K] weight of a W8 layout (see the module docstring); ``zero``
    (asymmetric int8: the scale's shape, or one per row [N, 1] under an unblocked scale)
    is subtracted from the codes before the scale."""
    assert weight.dtype in W8_DTYPES and weight.dim() == 2, (weight.dtype, weight.shape)
    shape = (weight.shape[0], weight.shape[1])
    codes = weight.float()
    if zero is not None:
        per_row = block is None and tuple(zero.shape) == (shape[0], 1)
        assert weight.dtype == torch.int8 and (zero.shape == scale.shape or per_row), (
            weight.dtype, zero.shape, scale.shape)
        codes = codes - expand_block_scale(zero, shape, block)
    return codes * expand_block_scale(scale, shape, block)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] uint8 -> [N, K] int32 codes 0..15 (low nibble first)."""
    assert packed.dtype == torch.uint8, packed.dtype
    low = (packed & 0x0F).to(torch.int32)
    high = (packed >> 4).to(torch.int32)
    return torch.stack((low, high), dim=-1).flatten(-2)


def dequantize_w4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  group_size: int) -> torch.Tensor:
    """The float32 [N, K] weight of a W4 layout, in its stored column order."""
    codes = unpack_int4(packed).float()  # [N, K]
    scale = scales.float().repeat_interleave(group_size, dim=1)[:, :codes.shape[1]]
    zero = (torch.full_like(scale, 8.0) if zeros is None
            else zeros.float().repeat_interleave(group_size, dim=1)[:, :codes.shape[1]])
    return (codes - zero) * scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 [..., N, K] weight of an MXFP4 layout (K = 32 * blocks.shape[-2])."""
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low = lut[(blocks & 0x0F).long()]
    high = lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., N, K // 32, 32]
    exponents = torch.exp2(scales.float() - 127.0).unsqueeze(-1)
    return (values * exponents).flatten(-2)


def quantized_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                               input_perm: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times a dequantized float32 weight [N, K]: float32 product, rounded to
    x's dtype once (``input_perm`` reorders x's columns first, as W4 act-order needs)."""
    x32 = x.float() if input_perm is None else x.float()[:, input_perm]
    out = x32 @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
