"""Launcher of the W8A8 int8 linear for the CPU path (cpu_quant_int8.c): x quantized per
token to int8 as compressed-tensors' dynamic symmetric token scheme does it, times int8
weight codes with a per-tensor or per-output-channel scale, by integer dot products
(AVX512_VNNI, or AVX2's vpmaddwd up to ``W8A8_AVX2_MAX_ROWS`` rows of x). What it
computes is engine/quantization/activations.py's ``w8a8_reference`` (x fake-quantized,
then the float32 product of the dequantized weight) up to the order of the float32
sums, except that x's codes times its scale are not rounded to a 16-bit x's dtype.

``cpu_w8a8_available(dtype)`` says where it runs: the library built with AVX512_VNNI
(and AVX512BW/VL) or AVX2, x float32 or bfloat16. Elsewhere the callers dequantize x's codes
(``cpu_int8_fake_quantize``, one C pass per row on any target, equal to the torch
reference bit for bit) and take the weight-only kernels (cpu_quant.py), which compute
the same product.
AMX-INT8 is not used (no host at hand to test it).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cpu_quant import cpu_w8_linear
from .native import NativeLibrary, declare

SOURCE = Path(__file__).with_name("cpu_quant_int8.c")
_KINDS = {torch.float32: 0, torch.bfloat16: 1}
# Past this many columns an int32 lane of the dot products could overflow.
MAX_IN_FEATURES = 65535

_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _declare(library: ctypes.CDLL) -> None:
    declare(library, ["quant_int8_vnni", "quant_int8_kernel"], [], ctypes.c_int)
    declare(library, ["int8_fake_quantize_rows"], [_P, _I, _I, _I, _N, _P, _N], None)
    declare(library, ["int8_quantize_rows"], [_P, _I, _I, _I, _N, _P, _P, _P, _N], None)
    if library.quant_int8_kernel():
        declare(library, ["w8a8_int8_linear"], [_P, _P, _P, _I, _P, _P, _N, _P, _P, _I, _I, _I, _N, _N, _P], None)


_LIBRARY = NativeLibrary(SOURCE, _declare, "W8A8 int8 linears take the weight-only kernels")
# The AVX2 integer kernel (quant_int8_kernel() == 1) takes at most this many rows of x:
# it multiplies each weight row by every row of x, so more rows take the weight-only
# kernels' prefill panels on x's fake-quantized values instead.
W8A8_AVX2_MAX_ROWS = 16


def _vnni_library() -> ctypes.CDLL | None:
    library = _LIBRARY.load()
    return library if library is not None and library.quant_int8_vnni() else None


def _kernel_library() -> ctypes.CDLL | None:
    """The library where it has an integer kernel (AVX512_VNNI or AVX2), else None."""
    library = _LIBRARY.load()
    return library if library is not None and library.quant_int8_kernel() else None


def w8a8_kernel_isa() -> str | None:
    """The instruction set of the integer kernel this build has ("AVX512_VNNI", or
    "AVX2" for its vpmaddwd kernel), None where it has none or the library did not build."""
    library = _kernel_library()
    return None if library is None else {2: "AVX512_VNNI", 1: "AVX2"}.get(library.quant_int8_kernel())


def cpu_w8a8_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the int8 x int8 kernel runs here for activations of ``dtype``."""
    return dtype in _KINDS and _kernel_library() is not None


def cpu_int8_fake_quantize_available(dtype: torch.dtype) -> bool:
    """Whether ``cpu_int8_fake_quantize`` runs here for x of ``dtype`` (the library
    built, on any target; x float32 or bfloat16)."""
    return dtype in _KINDS and _LIBRARY.load() is not None


def cpu_int8_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (rows of contiguous elements) quantized per token to int8 codes and
    multiplied back, in x's dtype: activations.py's ``fake_quantize_inputs(x, "int8")``
    bit for bit, in one pass per row (see cpu_quant_int8.c)."""
    library = _LIBRARY.load()
    assert library is not None and x.dtype in _KINDS, "call cpu_int8_fake_quantize_available first"
    assert x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1, (x.device, x.shape, x.stride())
    out = torch.empty(x.shape, dtype=x.dtype)
    library.int8_fake_quantize_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], _KINDS[x.dtype],
                                    out.data_ptr(), torch.get_num_threads())
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    assert x.device.type == "cpu" and x.dtype in _KINDS, (x.device, x.dtype)
    assert 0 < x.shape[-1] <= MAX_IN_FEATURES, tuple(x.shape)
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def cpu_int8_token_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] quantized per row by the C kernel: (codes int8 [M, K], scales float32
    [M], code sums int32 [M])."""
    library = _LIBRARY.load()
    assert library is not None, "the library did not build"
    x2 = _rows(x)
    rows, cols = x2.shape
    codes = torch.empty(rows, cols, dtype=torch.int8)
    scales = torch.empty(rows, dtype=torch.float32)
    sums = torch.empty(rows, dtype=torch.int32)
    library.int8_quantize_rows(x2.data_ptr(), x2.stride(0), rows, cols, _KINDS[x.dtype], codes.data_ptr(),
                               scales.data_ptr(), sums.data_ptr(), torch.get_num_threads())
    return codes, scales, sums


def cpu_w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] quantized per token, times ``weight`` [N, K] int8 codes times ``scale``
    float32 ([1, 1] or [N, 1]), plus ``bias`` -> [..., N] of x's dtype."""
    out_features, in_features = weight.shape
    assert weight.dtype == torch.int8 and weight.is_contiguous() and weight.device.type == "cpu", weight.dtype
    assert x.shape[-1] == in_features, (tuple(x.shape), in_features)
    assert scale.dtype == torch.float32 and scale.is_contiguous(), (scale.dtype, scale.stride())
    assert scale.shape in ((1, 1), (out_features, 1)), f"W8A8 scale {tuple(scale.shape)}: [1, 1] or [{out_features}, 1]"
    bias32 = None
    if bias is not None:
        assert bias.shape == (out_features,), tuple(bias.shape)
        bias32 = bias.detach().to(torch.float32).contiguous()
    library = _kernel_library()
    assert library is not None, "call cpu_w8a8_available first"
    rows = x.numel() // in_features
    scratch: torch.Tensor | None = None
    if library.quant_int8_kernel() == 1:  # AVX2: x's codes widened to int16 rows of whole vectors of 16
        if rows > W8A8_AVX2_MAX_ROWS:
            fake = cpu_int8_fake_quantize(_rows(x))
            return cpu_w8_linear(fake, weight, scale, bias=bias).view(*x.shape[:-1], out_features)
        scratch = torch.empty(rows, -(-in_features // 16) * 16, dtype=torch.int16)
    x2 = _rows(x)
    threads = torch.get_num_threads()
    # One scratch for a call's quantized x: codes [rows, K] int8, then scales float32 and
    # code sums int32 [rows] each (64-byte aligned parts, as the kernels' loads like).
    codes_bytes = -(-rows * in_features // 64) * 64
    quantized = torch.empty(codes_bytes + 2 * (-(-rows * 4 // 64) * 64), dtype=torch.uint8)
    codes = quantized.data_ptr()
    scales, sums = codes + codes_bytes, codes + codes_bytes + (quantized.numel() - codes_bytes) // 2
    library.int8_quantize_rows(x2.data_ptr(), x2.stride(0), rows, in_features, _KINDS[x.dtype], codes, scales, sums,
                               threads)
    out = torch.empty(rows, out_features, dtype=x.dtype)
    library.w8a8_int8_linear(codes, scales, sums, rows, weight.data_ptr(), scale.data_ptr(), int(scale.numel() > 1),
                             None if bias32 is None else bias32.data_ptr(), out.data_ptr(), out.stride(0),
                             out_features, in_features, _KINDS[x.dtype], threads,
                             None if scratch is None else scratch.data_ptr())
    return out.view(*x.shape[:-1], out_features)
