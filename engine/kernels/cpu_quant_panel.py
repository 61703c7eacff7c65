"""Prefill panels multiplied by oneDNN on a packed weight (cpu_quant_panel.c's launcher).

The quantized linears' prefill shapes (kernels/cpu_quant.py) multiply panels of weight
rows dequantized to x's dtype. Handed a plain panel, torch's matmul (oneDNN) would
reorder it into its blocked weight layout on every call; here the panel is dequantized
straight into the buffer of a packed weight (``torch.ops.mkldnn._reorder_linear_weight``'s
opaque tensor, whose bytes ``torch.ops.mkldnn.data_ptr`` exposes), and oneDNN's packed
linear multiplies it, as engine/cpu/linear.py's packed linears run.

The blocked layout is not read from oneDNN's headers but found by probing: a weight
whose elements encode their own index is packed, and the layout is taken only when
every element sits where ``BlockedLayout`` says (units of 4 bytes, rows in blocks);
anything else (another format on another CPU, a torch without these operators) leaves
the panel to torch's matmul.

Invariants:
- A packed panel's padding (columns past K, rows past the panel's) is zero from its
  creation and never written.
- Per-thread cache (``_PANELS``, cleared by ``clear_packed_panels``): one packed
  buffer per (rows, K, dtype), at most ``MAX_PANELS`` of them, each reused by every
  layer of that panel shape; a call fills it and multiplies it before the next fill,
  and no other thread writes it.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from .native import NativeLibrary, declare
from .onednn_rows import by_row_parts, padded_rows

SOURCE = Path(__file__).with_name("cpu_quant_panel.c")
# Packed panels kept at once (a model has a few panel shapes: each linear's full
# panel and its last, shorter one).
MAX_PANELS = 16
# The dtypes oneDNN packs, each with its elements per 4-byte unit of the layout.
_UNIT_ELEMENTS = {torch.float32: 1, torch.bfloat16: 2}
# Each dtype's bit in ``panel_vector_tiles()``: the dtypes a build fills in vector tiles.
_VECTOR_TILE_BITS = {torch.float32: 1, torch.bfloat16: 2}


def _declare(library: ctypes.CDLL) -> None:
    p, i, n = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    declare(library, ["w8_to_blocked"], [p, n, p, p, i, i, i, i, i, i, n, i, i, p, n], None)
    declare(library, ["w4_to_blocked"], [p, p, p, i, i, i, i, n, i, i, p, n], None)
    declare(library, ["panel_vector_tiles"], [], n)


_LIBRARY = NativeLibrary(SOURCE, _declare, "prefill panels are multiplied through torch's matmul")


@dataclass(frozen=True)
class BlockedLayout:
    """Where a [rows, K] weight's elements sit in a packed buffer, in 4-byte units:
    unit u of row r at ``(r // block_rows) * padded_units * block_rows + u * block_rows
    + r % block_rows``; ``units`` = K / (elements per unit)."""

    block_rows: int
    units: int
    padded_units: int


def packed_panels_available(dtype: torch.dtype) -> bool:
    """Whether prefill panels take this path for x of ``dtype``: oneDNN packs the dtype
    and cpu_quant_panel.c built with vector tiles of it (float32: AVX2 and AVX-512;
    bfloat16: AVX-512; element by element, the plain panels and torch's matmul are
    faster)."""
    if dtype not in _UNIT_ELEMENTS or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    library = _LIBRARY.load()
    return library is not None and bool(library.panel_vector_tiles() & _VECTOR_TILE_BITS[dtype])


def whole_runs(span: int, cols: int) -> bool:
    """Whether scales covering ``span`` of a row's ``cols`` columns (a W8 block, a W4
    group) never change within one of the vector tiles' runs (32 columns)."""
    return span % 32 == 0 or span >= cols


def _buffer(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A plain tensor of ``dtype`` over a packed (opaque) tensor's bytes."""
    nbytes = int(torch.ops.mkldnn._nbytes(packed))
    raw = (ctypes.c_uint8 * nbytes).from_address(int(torch.ops.mkldnn.data_ptr(packed)))
    return torch.frombuffer(raw, dtype=dtype)


def _packed_indices(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """For each element of the packed buffer, the plain index r * cols + c it holds,
    -1 for padding: each element encodes its index + 1 in digits exact in ``dtype``."""
    base = 256 if dtype == torch.bfloat16 else 1 << 24
    index = torch.arange(rows * cols, dtype=torch.int64).view(rows, cols)
    found: torch.Tensor | None = None
    place = 1
    while place < rows * cols + 1:
        digit = (index + 1) // place % base
        packed = torch.ops.mkldnn._reorder_linear_weight(digit.to(dtype), 1024)
        values = _buffer(packed, dtype).to(torch.int64)
        found = values * place if found is None else found + values * place
        place *= base
    assert found is not None
    return found - 1


def find_layout(rows: int, cols: int, dtype: torch.dtype) -> BlockedLayout | None:
    """The blocked layout oneDNN packs a [rows, cols] weight of ``dtype`` in, checked
    element by element, or None where it is not one ``BlockedLayout`` describes."""
    per_unit = _UNIT_ELEMENTS[dtype]
    if cols % per_unit or rows * cols >= 1 << 24:
        return None
    try:
        found = _packed_indices(rows, cols, dtype)
    except (RuntimeError, AttributeError, NotImplementedError):  # a torch without these operators
        return None
    if found.numel() % per_unit:
        return None
    first = found.view(-1, per_unit)[:, 0]
    second_unit = (first == per_unit).nonzero()  # row 0's second unit follows its block's first units
    if found[0] != 0 or second_unit.numel() == 0:
        return None
    block_rows = int(second_unit[0])
    blocks = -(-rows // block_rows)
    if first.numel() % (blocks * block_rows):
        return None
    layout = BlockedLayout(block_rows, cols // per_unit, first.numel() // (blocks * block_rows))
    return layout if torch.equal(found, _expected_indices(layout, rows, cols, per_unit)) else None


def _expected_indices(layout: BlockedLayout, rows: int, cols: int, per_unit: int) -> torch.Tensor:
    """``_packed_indices`` as ``layout`` says they should be."""
    offsets = torch.arange(-(-rows // layout.block_rows) * layout.block_rows * layout.padded_units)
    block, within = offsets // (layout.padded_units * layout.block_rows), offsets % (
        layout.padded_units * layout.block_rows)
    row, unit = block * layout.block_rows + within % layout.block_rows, within // layout.block_rows
    first = torch.where((row < rows) & (unit < layout.units), row * cols + unit * per_unit, -1)
    elements = first[:, None] + torch.arange(per_unit)
    return torch.where(first[:, None] >= 0, elements, -1).flatten()


class PackedPanel:
    """A packed weight buffer of one panel shape that plain panels are copied into."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, layout: BlockedLayout) -> None:
        self.rows, self.cols, self.dtype, self.layout = rows, cols, dtype, layout
        self.packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(rows, cols, dtype=dtype), 1024)
        self._units = _buffer(self.packed, torch.int32)

    def fill_w8(self, weight: torch.Tensor, scale: torch.Tensor, blocks: tuple[int, int], n0: int,
                threads: int, zero: torch.Tensor | None = None) -> None:
        """Rows n0 .. n0 + rows of a W8 weight (cpu_quant.cpu_w8_linear's layout, scale
        blocks of ``blocks`` = (rows, columns)) dequantized into the packed buffer;
        ``zero``: an int8 weight's zero points, int8, one per row ([N] or [N, 1]) or one
        for all (w = (code - zero) * scale, the difference taken in integers), None for
        none."""
        assert weight.shape[1] == self.cols and n0 + self.rows <= weight.shape[0], (tuple(weight.shape), n0)
        if zero is not None:
            assert weight.dtype == torch.int8, f"zero points are for int8 weights, not {weight.dtype}"
            assert zero.dtype == torch.int8 and zero.numel() in (1, weight.shape[0]), (zero.dtype, tuple(zero.shape))
            zero = zero.reshape(-1).expand(weight.shape[0]).contiguous()
        library = _LIBRARY.load()
        assert library is not None
        block_rows, block_cols = blocks
        library.w8_to_blocked(weight.data_ptr(), int(weight.dtype == torch.float8_e4m3fn), scale.data_ptr(),
                              None if zero is None else zero.data_ptr(), scale.shape[1], block_rows, block_cols,
                              n0, n0 + self.rows, self.cols,
                              int(self.dtype == torch.bfloat16), self.layout.block_rows, self.layout.padded_units,
                              self._units.data_ptr(), threads)

    def fill_w4(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                n0: int, threads: int) -> None:
        """Rows n0 .. n0 + rows of a W4 weight (cpu_quant.cpu_w4_linear's layout)
        dequantized into the packed buffer."""
        assert packed.shape[1] * 2 == self.cols and n0 + self.rows <= packed.shape[0], (tuple(packed.shape), n0)
        library = _LIBRARY.load()
        assert library is not None
        library.w4_to_blocked(packed.data_ptr(), scales.data_ptr(), None if zeros is None else zeros.data_ptr(),
                              group_size, n0, n0 + self.rows, self.cols, int(self.dtype == torch.bfloat16),
                              self.layout.block_rows, self.layout.padded_units, self._units.data_ptr(), threads)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, cols] @ panel.T (+ bias of the panel's dtype) -> [M, rows]: oneDNN's
        calls take the row counts the packed linears do (kernels/onednn_rows.py), each
        padded with zeros to its bucket and the padding dropped."""
        return by_row_parts(x, lambda part: self._rows_matmul(part, bias))

    def _rows_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        padded = padded_rows(x, x.dtype).contiguous()
        return torch.ops.mkldnn._linear_pointwise(padded, self.packed, bias, "none", [], "")[:x.shape[0]]


class _Panels(threading.local):
    """Each thread's packed panels by (rows, K, dtype), least recently used first."""

    def __init__(self) -> None:
        self.by_shape: OrderedDict[tuple[int, int, torch.dtype], PackedPanel | None] = OrderedDict()


_PANELS = _Panels()


def packed_panel(rows: int, cols: int, dtype: torch.dtype) -> PackedPanel | None:
    """This thread's packed panel for this shape (made on first use), or None where
    oneDNN packs it in a layout this file does not fill."""
    panels, key = _PANELS.by_shape, (rows, cols, dtype)
    if key in panels:
        panels.move_to_end(key)
        return panels[key]
    layout = _cached_layout(rows, cols, dtype)
    panel = None if layout is None else PackedPanel(rows, cols, dtype, layout)
    panels[key] = panel
    if len(panels) > MAX_PANELS:
        panels.popitem(last=False)
    return panel


@functools.lru_cache(maxsize=64)
def _cached_layout(rows: int, cols: int, dtype: torch.dtype) -> BlockedLayout | None:
    return find_layout(rows, cols, dtype)


def clear_packed_panels() -> None:
    """Drop this thread's cached packed panels (their memory goes back)."""
    _PANELS.by_shape.clear()
