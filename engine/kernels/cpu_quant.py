"""Launchers of the quantized linears for the CPU path (cpu_quant.c): x @ w.T + bias
with w in the W8 or W4 layout of kernels/quant_reference.py, whose
``quantized_linear_reference`` over the dequantized weight is what they compute.

Two paths by the number of rows of x. Up to ``DECODE_MAX_ROWS`` (the decode shapes)
the kernel streams the quantized weight once, dequantizing in registers, the threads
splitting the output columns; a decode step reads a quarter (W4) or half (W8) of the
bfloat16 weight's bytes. bfloat16 x on a build with AVX512_BF16 takes
cpu_quant_bf16.c's kernel instead, which multiplies the codes widened to bfloat16
(exactly) by the bfloat16 dot-product instruction: on hosts with AMX-BF16 fp8 and int8
weights go through AMX tiles (cpu_quant_amx.h), and with AVX512_VNNI int8 weights times
one row of x through integer byte products on x in fixed point (cpu_quant_digits.h),
each as exact as the float32 reference's sums; 4-bit groups of whole runs of 64
columns decode a run's codes by two table permutes, x reordered to match. There, up to ``TILE_MAX_ROWS``
rows take its register-blocked kernel (cpu_quant_blocked.h), which decodes a panel of
weight rows once per thread and multiplies it by every row of x; W8 weights with one
scale per row and K up to 1024 take its wide decode tile (cpu_quant_wide.h) for up to
16 rows (fp8: 12), each weight row decoded once in registers against every row of x,
no panel transposed. Above it (prefill), a panel of weight rows at a
time is dequantized to x's dtype (float32 where oneDNN has no matmul of x's 16-bit
dtype: ``panel_dtype``), straight into oneDNN's blocked weight layout where
cpu_quant_panel.py finds it (from ``PACKED_MIN_ROWS`` rows: float32 panels on AVX2 and
AVX-512 builds, bfloat16 ones on AVX-512) and multiplied by oneDNN's packed linear,
else into a plain scratch multiplied by torch's matmul, so
the prefill's speed stays that of the 16-bit matmul. A bfloat16 panel rounds each
dequantized weight to bfloat16 once (as transformers' own dequantizing loaders do);
the decode path and float32 activations keep the float32 weight. oneDNN's calls take
the row counts of the packed linears (kernels/onednn_rows.py).

x is float32, bfloat16 or float16 (``cpu_quant_available(dtype)``), the output of
x's dtype. Without a C compiler the library does not build and
``cpu_quant_available`` is False: the callers dequantize through quant_reference.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from .cpu_quant_panel import PackedPanel, packed_panel, packed_panels_available, whole_runs
from .native import NativeLibrary, declare
from .quant_reference import W8_DTYPES

SOURCE = Path(__file__).with_name("cpu_quant.c")
BF16_SOURCE = Path(__file__).with_name("cpu_quant_bf16.c")
# The C kernels' dtype codes for x, the output and the prefill panel.
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# At most this many rows of x take the streaming kernel; more go through panels.
DECODE_MAX_ROWS = 8
# With cpu_quant_bf16.c's dot-product kernels, up to this many rows of bfloat16 x take
# its register-blocked kernel (the weight decoded once per panel of output columns)
# instead of the prefill panels (measured faster up to here in bench_quant.py's kernel
# mode, slower at 512 rows, where oneDNN's packed panels win).
TILE_MAX_ROWS = 256
# cpu_quant.c's fp8 argument for float8_e4m3fn codes none of which is NaN.
FP8_FINITE = 2
# Added to cpu_quant_bf16.c's decode fp8 argument: one row of x times int8 codes stays on
# the bfloat16 tiles instead of the digit products (cpu/paths.py's quant_digits_kernel).
W8_NO_DIGITS = 4
# A prefill panel's size: the dequantized rows stay in the cache while the matmul reads them.
PANEL_BYTES = 2 << 20
# Where oneDNN multiplies panels packed in its blocked layout (kernels/cpu_quant_panel.py):
# panels of this size (still in the cache when oneDNN reads them), but at least 1024
# rows up to 4x the size: oneDNN's matmul is slower on fewer rows of weight.
PACKED_PANEL_BYTES = 4 << 20
# From this many rows of x the packed panels are taken: below it, dequantizing a panel
# into the blocked layout costs more than oneDNN's own reorder of a plain one saves
# (measured in bench_quant.py's kernel mode: slower at 128 rows, faster from 512).
PACKED_MIN_ROWS = 256

_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "w8_linear": [_P, _I, _N, _P, _I, _P, _N, _P, _P, _I, _I, _I, _P, _P, _I, _I, _I, _N],
    "w4_linear": [_P, _I, _N, _P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _N],
    "w8_dequantize": [_P, _N, _P, _P, _I, _I, _I, _I, _I, _I, _P, _N, _N],
    "w4_dequantize": [_P, _P, _P, _I, _I, _I, _I, _P, _N, _N],
}


def _declare(library: ctypes.CDLL) -> None:
    for name, argtypes in _SIGNATURES.items():
        declare(library, [name], argtypes, None)
    declare(library, ["quant_takes_float16"], [], ctypes.c_int)


_LIBRARY = NativeLibrary(SOURCE, _declare, "quantized linears dequantize their weight through torch")
_BF16_SIGNATURES = {
    "w8_linear_bf16": [_P, _I, _I, _P, _N, _P, _I, _I, _I, _P, _P, _I, _I, _I, _N],
    "w4_linear_bf16": [_P, _I, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _N],
    "w8_blocked_bf16": [_P, _I, _I, _P, _N, _P, _I, _I, _I, _P, _P, _I, _I, _I, _N],
    "w4_blocked_bf16": [_P, _I, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _N],
}


def _declare_bf16(library: ctypes.CDLL) -> None:
    declare(library, ["quant_bf16_dot"], [], ctypes.c_int)
    if library.quant_bf16_dot():
        for name, argtypes in _BF16_SIGNATURES.items():
            declare(library, [name], argtypes, None)
        declare(library, ["quant_amx_ready", "quant_digits_ready"], [], ctypes.c_int)
        declare(library, ["quant_amx_allow"], [_N], None)


_BF16_LIBRARY = NativeLibrary(BF16_SOURCE, _declare_bf16, "bfloat16 decode shapes take the float32 kernel")


def _bf16_dot_library() -> ctypes.CDLL | None:
    """cpu_quant_bf16.c's library where it was built with AVX512_BF16, else None."""
    library = _BF16_LIBRARY.load()
    return library if library is not None and library.quant_bf16_dot() else None


def bfloat16_tiles_ready() -> bool:
    """Whether bfloat16 x of up to TILE_MAX_ROWS rows takes cpu_quant_bf16.c's
    dot-product kernels here (built with AVX512_BF16): each output column summed alone,
    in the kernel's own order. Elsewhere, past DECODE_MAX_ROWS rows, x goes through the
    prefill panels, whose matmul may order a column's sums by the output's width."""
    return _bf16_dot_library() is not None


def amx_tiles_ready() -> bool:
    """Whether bfloat16 x's kernels multiply through AMX tiles here (cpu_quant_amx.h:
    built with AMX-BF16, the tiles granted by the OS and allowed)."""
    library = _bf16_dot_library()
    return library is not None and bool(library.quant_amx_ready())


def allow_amx_tiles(allowed: bool) -> None:
    """Let the kernels take AMX tiles where the host has them (the default), or not:
    the AVX-512 paths then run, as on a host without AMX (tests check both)."""
    library = _bf16_dot_library()
    if library is not None:
        library.quant_amx_allow(int(allowed))


def digit_tiles_ready() -> bool:
    """Whether int8 weights times one row of bfloat16 x can take the integer byte
    products on x in fixed point here (cpu_quant_digits.h: built with AVX512_VNNI)."""
    library = _bf16_dot_library()
    return library is not None and bool(library.quant_digits_ready())


def cpu_quant_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernels built here and take activations of ``dtype``."""
    library = _LIBRARY.load()
    if library is None or dtype not in _KINDS:
        return False
    return dtype != torch.float16 or bool(library.quant_takes_float16())


def w4_layout_supported(in_features: int, group_size: int) -> bool:
    """Whether ``cpu_w4_linear`` takes groups of ``group_size`` over ``in_features`` columns."""
    return group_size > 0 and group_size % 2 == 0 and in_features % group_size == 0


def _library() -> ctypes.CDLL:
    library = _LIBRARY.load()
    assert library is not None, "call cpu_quant_available first"
    return library


def w8_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int]:
    """The (rows, columns) of weight one scale covers: the whole weight for a [1, 1]
    scale, a row for an [N, 1] one, ``block`` otherwise (see quant_reference)."""
    rows, cols = weight.shape
    if block is None:
        if scale.numel() == 1:
            return rows, cols
        assert scale.shape == (rows, 1), f"a W8 scale without a block is [1, 1] or [{rows}, 1], not {scale.shape}"
        return 1, cols
    block_rows, block_cols = block
    assert block_rows > 0 and block_cols > 0, block
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    assert tuple(scale.shape) == expected, f"W8 block scale {tuple(scale.shape)}, expected {expected}"
    return block_rows, block_cols


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [..., K] as [M, K] with contiguous rows, checked."""
    assert x.device.type == "cpu" and x.dtype in _KINDS, (x.device, x.dtype)
    assert x.shape[-1] == in_features, (tuple(x.shape), in_features)
    rows = x.reshape(-1, in_features)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _float32_vector(values: torch.Tensor | None, size: int, name: str) -> torch.Tensor | None:
    if values is None:
        return None
    assert values.shape == (size,), f"{name} {tuple(values.shape)}, expected [{size}]"
    return values.detach().to(torch.float32).contiguous()


def zero_points(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor | None:
    """An asymmetric int8 weight's zero points as the C kernels read them: int8 of the
    scale's shape, contiguous; None for a symmetric weight. QuantizedLinear already holds
    them as int8 from load; integer values of another dtype (a test's, a reference's) are
    converted."""
    if zero is None:
        return None
    assert weight.dtype == torch.int8, f"zero points on a {weight.dtype} weight"
    assert zero.shape == scale.shape, f"zero points {tuple(zero.shape)}, the scale is {tuple(scale.shape)}"
    codes = zero.detach().to(torch.int8).contiguous()
    assert torch.equal(codes.to(zero.dtype), zero), "zero points are integers in int8's range"
    return codes


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _packed_panel_rows(row_bytes: int) -> int:
    """Weight rows per packed panel (see PACKED_PANEL_BYTES), a multiple of 64."""
    rows = max(PACKED_PANEL_BYTES // row_bytes, min(1024, 4 * PACKED_PANEL_BYTES // row_bytes))
    return max(64, rows // 64 * 64)


@functools.cache
def panel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype prefill panels are dequantized to for x of ``dtype``: x's own, but
    float32 for a 16-bit x where oneDNN has no matmul of that dtype on this CPU (no
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT): torch's 16-bit matmul is then several times
    slower than its float32 one, and a float32 panel keeps the weight unrounded."""
    supported = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}.get(dtype)
    if supported is None or (torch.backends.mkldnn.is_available() and supported()):
        return dtype
    return torch.float32


def _panel_product(x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                   dequantize: Callable[[int, int, torch.Tensor], None],
                   to_blocked: Callable[[int, PackedPanel], None] | None) -> torch.Tensor:
    """out[:, n0:n1] = x @ panel.T (+ bias) over panels of weight rows, returning out (or
    the one packed panel's product where it covers the weight); x: [M, K]. Where
    oneDNN packs the panel's dtype (``panel_dtype``) in a layout cpu_quant_panel.py
    fills, ``to_blocked(n0, panel)`` (None: the weight's scales do not suit it)
    dequantizes each panel straight into a packed weight that oneDNN multiplies; else
    ``dequantize(n0, n1, panel)`` fills a plain scratch for torch's matmul. A float32
    panel for a 16-bit x multiplies x widened and rounds each panel's product once, as
    it is copied into out (no float32 copy of the whole output)."""
    x = x.to(panel_dtype(x.dtype))
    in_features, out_features = x.shape[1], out.shape[1]
    packs = to_blocked is not None and x.shape[0] >= PACKED_MIN_ROWS and packed_panels_available(x.dtype)
    row_bytes = in_features * x.element_size()
    panel_rows = _packed_panel_rows(row_bytes) if packs else max(16, PANEL_BYTES // row_bytes)
    bias = None if bias is None else bias.to(x.dtype)
    scratch: torch.Tensor | None = None
    for n0 in range(0, out_features, panel_rows):
        n1 = min(out_features, n0 + panel_rows)
        packed = packed_panel(n1 - n0, in_features, x.dtype) if packs else None
        panel_bias = None if bias is None else bias[n0:n1]
        if packed is not None and to_blocked is not None:
            to_blocked(n0, packed)
            product = packed.matmul(x, panel_bias)
            if n1 - n0 == out_features:
                return product.to(out.dtype)
            out[:, n0:n1] = product
            continue
        if scratch is None:
            scratch = torch.empty(min(panel_rows, out_features), in_features, dtype=x.dtype)
        rows = scratch[: n1 - n0]
        dequantize(n0, n1, rows)
        out[:, n0:n1] = torch.mm(x, rows.t()) if panel_bias is None else torch.addmm(panel_bias, x, rows.t())
    return out


def cpu_w8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  block: tuple[int, int] | None = None, bias: torch.Tensor | None = None,
                  zero: torch.Tensor | None = None, digits: bool = True) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) -> [..., N] of x's dtype; w: ``weight`` [N, K] int8 or
    float8_e4m3fn times ``scale`` float32 ([1, 1], [N, 1], or per ``block``), less
    ``zero`` first (an asymmetric int8 weight's zero points, of the scale's shape;
    see ``zero_points``). cpu_quant_bf16.c's kernels take no zero points: an
    asymmetric weight's bfloat16 x is widened by cpu_quant.c's in every build.
    ``digits``: one row of bfloat16 x times int8 codes may take the digit products
    (``digit_tiles_ready``), else the bfloat16 tiles."""
    out_features, in_features = weight.shape
    assert weight.dtype in W8_DTYPES and weight.is_contiguous() and weight.device.type == "cpu", weight.dtype
    assert scale.dtype == torch.float32 and scale.is_contiguous(), (scale.dtype, scale.stride())
    block_rows, block_cols = w8_blocks(weight, scale, block)
    scale_cols = -(-in_features // block_cols)
    zero8 = zero_points(weight, scale, zero)
    x2 = _rows(x, in_features)
    bias32 = _float32_vector(bias, out_features, "bias")
    out = torch.empty(x2.shape[0], out_features, dtype=x.dtype)
    fp8, kind, threads = int(weight.dtype == torch.float8_e4m3fn), _KINDS[x.dtype], torch.get_num_threads()
    library = _library()
    dot_library = _bf16_dot_library() if x.dtype == torch.bfloat16 and zero8 is None else None
    if x2.shape[0] <= TILE_MAX_ROWS and dot_library is not None:
        decode = x2.shape[0] <= DECODE_MAX_ROWS
        kernel = dot_library.w8_linear_bf16 if decode else dot_library.w8_blocked_bf16
        codes = fp8 | (W8_NO_DIGITS if decode and not digits else 0)
        kernel(x2.data_ptr(), x2.stride(0), x2.shape[0], weight.data_ptr(), codes, scale.data_ptr(), scale_cols,
               block_rows, block_cols, _pointer(bias32), out.data_ptr(), out.stride(0), out_features, in_features,
               threads)
    elif x2.shape[0] <= DECODE_MAX_ROWS:
        scratch = torch.empty(x2.shape, dtype=torch.float32)
        library.w8_linear(x2.data_ptr(), x2.stride(0), kind, scratch.data_ptr(), x2.shape[0], weight.data_ptr(),
                          fp8, scale.data_ptr(), _pointer(zero8), scale_cols, block_rows, block_cols,
                          _pointer(bias32), out.data_ptr(), out.stride(0), out_features, in_features, threads)
    else:
        def dequantize(n0: int, n1: int, panel: torch.Tensor) -> None:
            library.w8_dequantize(weight.data_ptr(), fp8, scale.data_ptr(), _pointer(zero8), scale_cols,
                                  block_rows, block_cols, n0, n1, in_features, panel.data_ptr(),
                                  _KINDS[panel.dtype], threads)

        def to_blocked(n0: int, panel: PackedPanel) -> None:
            panel.fill_w8(weight, scale, (block_rows, block_cols), n0, threads, zero=zero8)
        # The packed fill takes zero points per tensor or row, not per block.
        packs = whole_runs(block_cols, in_features) and (zero8 is None or block is None)
        out = _panel_product(x2, out, bias, dequantize, to_blocked if packs else None)
    return out.view(*x.shape[:-1], out_features)


def cpu_w4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  group_size: int, bias: torch.Tensor | None = None,
                  input_perm: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) -> [..., N] of x's dtype; w: ``packed`` [N, K / 2]
    uint8 nibbles, ``scales`` and ``zeros`` (None: 8) float32 [N, K / group_size];
    ``input_perm`` [K] reorders x's columns first (act-order)."""
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    assert packed.dtype == torch.uint8 and packed.is_contiguous() and packed.device.type == "cpu", packed.dtype
    assert w4_layout_supported(in_features, group_size), (group_size, in_features)
    groups = (out_features, in_features // group_size)
    for table in (scales,) if zeros is None else (scales, zeros):
        assert table.dtype == torch.float32 and table.is_contiguous(), (table.dtype, table.stride())
        assert tuple(table.shape) == groups, f"W4 scales/zeros {tuple(table.shape)}, expected {groups}"
    if input_perm is not None:
        assert input_perm.shape == (in_features,), tuple(input_perm.shape)
        x = x.index_select(-1, input_perm)
    x2 = _rows(x, in_features)
    bias32 = _float32_vector(bias, out_features, "bias")
    out = torch.empty(x2.shape[0], out_features, dtype=x.dtype)
    kind, threads, library = _KINDS[x.dtype], torch.get_num_threads(), _library()
    dot_library = _bf16_dot_library() if x.dtype == torch.bfloat16 and group_size % 32 == 0 else None
    if x2.shape[0] <= TILE_MAX_ROWS and dot_library is not None:
        sums = torch.empty(x2.shape[0], in_features // group_size, dtype=torch.float32)
        kernel = dot_library.w4_linear_bf16 if x2.shape[0] <= DECODE_MAX_ROWS else dot_library.w4_blocked_bf16
        kernel(x2.data_ptr(), x2.stride(0), x2.shape[0], sums.data_ptr(), packed.data_ptr(), scales.data_ptr(),
               _pointer(zeros), group_size, _pointer(bias32), out.data_ptr(), out.stride(0), out_features,
               in_features, threads)
    elif x2.shape[0] <= DECODE_MAX_ROWS:
        scratch = torch.empty(x2.shape[0], in_features + in_features // group_size, dtype=torch.float32)
        library.w4_linear(x2.data_ptr(), x2.stride(0), kind, scratch.data_ptr(), x2.shape[0], packed.data_ptr(),
                          scales.data_ptr(), _pointer(zeros), group_size, _pointer(bias32), out.data_ptr(),
                          out.stride(0), out_features, in_features, threads)
    else:
        def dequantize(n0: int, n1: int, panel: torch.Tensor) -> None:
            library.w4_dequantize(packed.data_ptr(), scales.data_ptr(), _pointer(zeros), group_size, n0, n1,
                                  in_features, panel.data_ptr(), _KINDS[panel.dtype], threads)

        def to_blocked(n0: int, panel: PackedPanel) -> None:
            panel.fill_w4(packed, scales, zeros, group_size, n0, threads)
        out = _panel_product(x2, out, bias, dequantize, to_blocked if whole_runs(group_size, in_features) else None)
    return out.view(*x.shape[:-1], out_features)


class DecodeCall:
    """One linear's call of a decode kernel for bfloat16 x with the weight's layout
    checked and its arguments bound once (``w8_decode_call`` / ``w4_decode_call``): a
    call checks x and passes it and a fresh output, so a decode step's many small
    products do not each pay the launcher's checks. The kernel is cpu_quant_bf16.c's
    where that library has its dot products, else cpu_quant.c's (``widens``: x is
    widened to float32 into a scratch the call passes; ``w4_groups``: a W4 weight's groups
    per row, for the kernels' scratch of x's sums per group). ``source``: the layer's tensors
    (and a W8 call's digits flag) it was bound to (``binds`` tells whether they still are
    the layer's); ``held``: the tensors made for it (the float32 bias, int8 zero points)
    its pointers also address."""

    def __init__(self, kernel: Callable[..., None], weight_args: tuple[int | None, ...],
                 source: tuple[torch.Tensor | bool | None, ...], held: tuple[torch.Tensor | None, ...],
                 out_features: int, in_features: int, w4_groups: int, widens: bool = False) -> None:
        self.kernel, self.weight_args, self.source, self.held = kernel, weight_args, source, held
        self.out_features, self.in_features, self.w4_groups = out_features, in_features, w4_groups
        self.widens = widens

    def binds(self, source: tuple[torch.Tensor | bool | None, ...]) -> bool:
        """Whether this call was bound to exactly these tensors (by identity). Asked on
        every decode call of every linear: a plain loop, no generator."""
        if len(source) != len(self.source):
            return False
        for given, bound in zip(source, self.source, strict=True):
            if given is not bound:
                return False
        return True

    def __getstate__(self) -> dict[str, object]:
        # A copy (deepcopy, pickle) binds nothing: its pointers would address the originals.
        return {"source": ()}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bfloat16, M <= DECODE_MAX_ROWS, rows of contiguous elements -> [M, N] bfloat16."""
        rows = x.shape[0]
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1, (x.dtype, x.shape, x.stride())
        assert 0 < rows <= DECODE_MAX_ROWS and x.shape[1] == self.in_features, (tuple(x.shape), self.in_features)
        out = torch.empty(rows, self.out_features, dtype=torch.bfloat16)
        scratch: torch.Tensor | None = None  # held through the call
        if self.widens:  # cpu_quant.c's: x's kind, then its float32 copy (and W4: x's sums per group)
            scratch = torch.empty(rows, self.in_features + self.w4_groups, dtype=torch.float32)
            head: tuple[int, ...] = (x.data_ptr(), x.stride(0), _KINDS[torch.bfloat16], scratch.data_ptr(), rows)
        else:
            head = (x.data_ptr(), x.stride(0), rows)
            if self.w4_groups:  # the kernel's scratch of x's sums per group
                scratch = torch.empty(rows, self.w4_groups, dtype=torch.float32)
                head += (scratch.data_ptr(),)
        self.kernel(*head, *self.weight_args, out.data_ptr(), self.out_features, self.out_features,
                    self.in_features, torch.get_num_threads())
        return out


def fp8_nan_codes(weight: torch.Tensor) -> bool:
    """Whether a float8_e4m3fn weight holds a NaN code (0x7f or 0xff): a decode call bound
    to one without tells cpu_quant.c's kernel so (FP8_FINITE), which then decodes its
    codes without the NaN test. Read once per binding: the bound tensors are not
    written in place."""
    return bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any())


def _widening_library() -> ctypes.CDLL | None:
    """cpu_quant.c's library where cpu_quant_bf16.c has no dot products here and it
    takes bfloat16 x (its decode kernels then run bfloat16 decode shapes), else None."""
    return _LIBRARY.load() if _bf16_dot_library() is None and cpu_quant_available(torch.bfloat16) else None


def w8_decode_call(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   bias: torch.Tensor | None, zero: torch.Tensor | None = None,
                   digits: bool = True) -> DecodeCall | None:
    """``cpu_w8_linear``'s decode shapes for bfloat16 x bound to this weight (``zero``:
    an asymmetric int8 weight's zero points, which only cpu_quant.c's kernel takes;
    ``digits`` as there), or None where no library that takes it built."""
    library = _bf16_dot_library() if zero is None else None
    widening = _widening_library() if zero is None else (
        _LIBRARY.load() if cpu_quant_available(torch.bfloat16) else None)
    if library is None and widening is None:
        return None
    out_features, in_features = weight.shape
    assert weight.dtype in W8_DTYPES and weight.is_contiguous() and weight.device.type == "cpu", weight.dtype
    assert scale.dtype == torch.float32 and scale.is_contiguous(), (scale.dtype, scale.stride())
    block_rows, block_cols = w8_blocks(weight, scale, block)
    bias32 = _float32_vector(bias, out_features, "bias")
    zero8 = zero_points(weight, scale, zero)
    fp8, scale_cols = int(weight.dtype == torch.float8_e4m3fn), -(-in_features // block_cols)
    if library is not None:
        codes = fp8 | (0 if digits else W8_NO_DIGITS)
        args = (weight.data_ptr(), codes, scale.data_ptr(), scale_cols, block_rows, block_cols, _pointer(bias32))
        return DecodeCall(library.w8_linear_bf16, args, (weight, scale, zero, bias, digits), (bias32,),
                          out_features, in_features, 0)
    assert widening is not None
    if fp8 and not fp8_nan_codes(weight):
        fp8 = FP8_FINITE
    args = (weight.data_ptr(), fp8, scale.data_ptr(), _pointer(zero8), scale_cols, block_rows, block_cols,
            _pointer(bias32))
    return DecodeCall(widening.w8_linear, args, (weight, scale, zero, bias, digits), (bias32, zero8),
                      out_features, in_features, 0, widens=True)


def w4_decode_call(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                   bias: torch.Tensor | None) -> DecodeCall | None:
    """``cpu_w4_linear``'s decode shapes for bfloat16 x bound to this weight (no
    act-order permutation: the caller applies it), or None where the layout is not
    taken: cpu_quant_bf16.c's dot products take groups of whole vectors of 32 only."""
    library, widening = _bf16_dot_library(), _widening_library()
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    if not w4_layout_supported(in_features, group_size) or (library is None and widening is None):
        return None
    if library is not None and group_size % 32:
        return None
    assert packed.dtype == torch.uint8 and packed.is_contiguous() and packed.device.type == "cpu", packed.dtype
    groups = in_features // group_size
    for table in (scales,) if zeros is None else (scales, zeros):
        assert table.dtype == torch.float32 and table.is_contiguous(), (table.dtype, table.stride())
        assert tuple(table.shape) == (out_features, groups), f"W4 scales/zeros {tuple(table.shape)}"
    bias32 = _float32_vector(bias, out_features, "bias")
    args = (packed.data_ptr(), scales.data_ptr(), _pointer(zeros), group_size, _pointer(bias32))
    if library is None:
        assert widening is not None
        return DecodeCall(widening.w4_linear, args, (packed, scales, zeros, bias), (bias32,), out_features,
                          in_features, groups, widens=True)
    return DecodeCall(library.w4_linear_bf16, args, (packed, scales, zeros, bias), (bias32,), out_features,
                      in_features, groups)
