"""Launcher of the MXFP4 matmul on the CPU (cpu_mxfp4.c): x @ w.T with w one expert's
weight in quant_reference.py's MXFP4 layout, computing ``x @ dequantize_mxfp4(w).T``
in float32 (the summation order aside).

Up to ``KERNEL_MAX_ROWS`` rows of x (the tokens one expert gets in a decode step) the
kernel streams the 4.25-bit weight, decoding each 32-weight group in registers once
per eight rows of x, the threads splitting the output rows. More rows (prefill)
dequantize a panel of weight rows at a time and multiply it by torch's matmul in x's
dtype. Without
a C compiler the library does not build and ``cpu_mxfp4_available`` is False: the
caller dequantizes tiles through torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native import NativeLibrary, declare

SOURCE = Path(__file__).with_name("cpu_mxfp4.c")
MXFP4_BLOCK = 32
X_DTYPES = (torch.float32, torch.bfloat16)
# Up to this many rows of x the kernel streams the weight; more rows multiply panels of
# dequantized weight rows by torch's matmul (oneDNN's bfloat16 dot products win there).
KERNEL_MAX_ROWS = 16
PANEL_BYTES = 4 << 20  # a panel of float32 weight rows

_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _declare(library: ctypes.CDLL) -> None:
    declare(library, ["mxfp4_matmul"], [_P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _N], None)
    declare(library, ["mxfp4_dequantize"], [_P, _P, _P, _P, _I, _I, _I, _N, _N], None)


_LIBRARY = NativeLibrary(SOURCE, _declare, "MXFP4 experts dequantize tiles through torch")


def cpu_mxfp4_available() -> bool:
    """Whether the kernel built here."""
    return _LIBRARY.load() is not None


def _check_layout(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, exponents: torch.Tensor) -> None:
    rows, groups = scales.shape
    assert x.dtype in X_DTYPES and x.dim() == 2 and x.device.type == "cpu", (x.dtype, x.shape, x.device)
    assert x.shape[1] == groups * MXFP4_BLOCK, f"x {tuple(x.shape)} against {groups} groups of {MXFP4_BLOCK}"
    assert blocks.dtype == scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)
    assert tuple(blocks.shape) == (rows, groups, MXFP4_BLOCK // 2), (blocks.shape, scales.shape)
    assert blocks.is_contiguous() and scales.is_contiguous(), "blocks and scales must be contiguous"
    assert exponents.dtype == torch.float32 and exponents.shape == (256,) and exponents.is_contiguous()


def cpu_mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                     exponents: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) times the weight of ``blocks`` [N, K // 32, 16] /
    ``scales`` [N, K // 32] transposed: float32 [M, N]. ``exponents`` [256] float32:
    2^(s - 127) for each scale byte s."""
    _check_layout(x, blocks, scales, exponents)
    library = _LIBRARY.load()
    assert library is not None, "cpu_mxfp4 did not build; check cpu_mxfp4_available() first"
    rows, groups = scales.shape
    threads = torch.get_num_threads()
    if x.shape[0] > KERNEL_MAX_ROWS:
        return _panel_matmul(library, x, blocks, scales, exponents)
    x32 = x.float()
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    x_even, x_odd = x32[:, 0::2].contiguous(), x32[:, 1::2].contiguous()
    library.mxfp4_matmul(x_even.data_ptr(), x_odd.data_ptr(), x.shape[0], blocks.data_ptr(), scales.data_ptr(),
                         exponents.data_ptr(), out.data_ptr(), rows, rows, groups, threads)
    return out


def _panel_matmul(library: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                  exponents: torch.Tensor) -> torch.Tensor:
    """Many rows of x: a panel of weight rows dequantized at a time (exactly, in x's
    dtype: an E2M1 value times a power of two is a bfloat16 too) and multiplied by
    torch's matmul, accumulating in float32. out.T's rows are contiguous, so each
    panel's product is written in place."""
    rows, groups = scales.shape
    cols = groups * MXFP4_BLOCK
    out_t = torch.empty(rows, x.shape[0], dtype=torch.float32)
    panel_rows = max(1, PANEL_BYTES // (x.element_size() * cols))
    panel = torch.empty(min(panel_rows, rows), cols, dtype=x.dtype)
    for start in range(0, rows, panel_rows):
        stop = min(start + panel_rows, rows)
        library.mxfp4_dequantize(blocks.data_ptr(), scales.data_ptr(), exponents.data_ptr(), panel.data_ptr(),
                                 start, stop, groups, int(x.dtype == torch.bfloat16), torch.get_num_threads())
        if x.dtype == torch.float32:
            torch.matmul(panel[:stop - start], x.t(), out=out_t[start:stop])
        else:  # bfloat16: one product rounded to bfloat16, as transformers' bfloat16 experts compute it
            out_t[start:stop] = torch.matmul(panel[:stop - start], x.t())
    return out_t.t()


def cpu_mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, exponents: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] of ``blocks`` / ``scales`` in ``dtype`` (float32 or bfloat16;
    for tests and checks)."""
    rows, groups = scales.shape
    _check_layout(torch.empty(0, groups * MXFP4_BLOCK, dtype=dtype), blocks, scales, exponents)
    library = _LIBRARY.load()
    assert library is not None, "cpu_mxfp4 did not build; check cpu_mxfp4_available() first"
    out = torch.empty(rows, groups * MXFP4_BLOCK, dtype=dtype)
    library.mxfp4_dequantize(blocks.data_ptr(), scales.data_ptr(), exponents.data_ptr(), out.data_ptr(), 0, rows,
                             groups, int(dtype == torch.bfloat16), torch.get_num_threads())
    return out
