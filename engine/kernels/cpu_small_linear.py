"""Launcher of the small-batch linear for the CPU path (cpu_small_linear.c), beside its
plain-torch reference: out = x @ w.T (+ bias) for float32 or bfloat16 x and weight.

The kernel reads a weight in blocks of BN outputs by K (cpu_small_linear.c), in
which a tile of rows of x reads each block's weights as one stream. That is the
layout oneDNN packs float32 and bfloat16 linear weights in on AVX-512 hosts (blocks
of 64 outputs; bfloat16 as pairs of k), so ``onednn_view`` lets the kernel read
oneDNN's own packed copy where its bytes are that layout: no second copy. The
check is exact: the view is made only where the packed bytes equal
``pack_small_linear``'s packing of the weight, byte for byte. Sums run in float32 in
the kernel's own order (bfloat16 outputs rounded once), as oneDNN's and torch's
float32-accumulating products do in theirs. ``small_linear_available(dtype)`` says
whether the library built here and takes the dtype; without it the callers keep
oneDNN alone.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .native import NativeLibrary, declare

SOURCE = Path(__file__).with_name("cpu_small_linear.c")
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGTYPES = [_P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _N]
# The widest block the kernel reads (MAX_BN in cpu_small_linear.c).
MAX_BLOCK = 128


def _declare(library: ctypes.CDLL) -> None:
    declare(library, [f"small_linear_{suffix}" for suffix in _SUFFIXES.values()], _ARGTYPES, None)
    declare(library, ["small_linear_vector", "small_linear_dot_bf16", "small_linear_amx_ready"], [], ctypes.c_int)
    declare(library, ["small_linear_amx_allow"], [_N], None)


_LIBRARY = NativeLibrary(SOURCE, _declare, "linears stay on oneDNN")


def small_linear_available(dtype: torch.dtype) -> bool:
    return dtype in _SUFFIXES and _LIBRARY.load() is not None


def _library() -> ctypes.CDLL:
    library = _LIBRARY.load()
    assert library is not None, "call small_linear_available first"
    return library


def amx_tiles_ready() -> bool:
    """Whether bfloat16 calls multiply through AMX tiles here (cpu_small_linear.c: built
    with AMX-BF16, the tiles granted by the OS and allowed)."""
    library = _LIBRARY.load()
    return library is not None and bool(library.small_linear_amx_ready())


def allow_amx_tiles(allowed: bool) -> None:
    """Let bfloat16 calls take AMX tiles where the host has them (the default), or not:
    the vector kernel then runs, as on a host without AMX (tests check both)."""
    library = _LIBRARY.load()
    if library is not None:
        library.small_linear_amx_allow(int(allowed))


def vector_width() -> int:
    """float32 lanes per vector in this build; a block's outputs are a multiple of twice it."""
    return _vector_width(_library())


@functools.cache
def _vector_width(library: ctypes.CDLL) -> int:
    return int(library.small_linear_vector())


@dataclass(frozen=True)
class SmallLinearWeight:
    """A weight [out_features, in_features] as the kernel reads it: blocks of ``block``
    outputs, each ``block_stride`` elements of ``storage`` (float32 [NB, Kp, BN];
    bfloat16 [NB, Kp / 2, BN, 2]), zero past the weight. ``storage`` is a plain
    tensor or oneDNN's opaque packed one, whose memory it is."""

    storage: torch.Tensor
    block: int
    block_stride: int
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        # Checked once here rather than on each call (small_linear checks the block
        # against the vector width of the build it runs).
        assert self.storage.is_mkldnn or self.storage.is_contiguous()
        assert self.block <= MAX_BLOCK, self.block

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @functools.cached_property
    def address(self) -> int:
        """Where the storage's memory starts (read once: the packed tensor never moves)."""
        return torch.ops.mkldnn.data_ptr(self.storage) if self.storage.is_mkldnn else self.storage.data_ptr()

    def data_ptr(self) -> int:
        return self.address


def pack_small_linear(weight: torch.Tensor, block: int | None = None, padded_k: int | None = None
                      ) -> SmallLinearWeight:
    """``weight`` [N, K] (float32 or bfloat16, on the CPU) in the kernel's layout: blocks
    of ``block`` outputs (default twice the build's vector), ``padded_k`` >= K rows of k
    (default K, rounded up to even for bfloat16)."""
    assert weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype in _SUFFIXES, (
        weight.shape, weight.device, weight.dtype)
    out_features, in_features = weight.shape
    width = block or 2 * vector_width()
    assert width % (2 * vector_width()) == 0 and width <= MAX_BLOCK, (width, vector_width())
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    columns = padded_k or -(-in_features // pair) * pair
    assert columns >= in_features and columns % pair == 0, (columns, in_features)
    blocks = -(-out_features // width)
    padded = weight.detach().new_zeros(blocks * width, columns)
    padded[:out_features, :in_features] = weight.detach()
    # [NB, BN, Kp / pair, pair] -> [NB, Kp / pair, BN, pair]
    packed = padded.view(blocks, width, columns // pair, pair).transpose(1, 2).contiguous()
    return SmallLinearWeight(packed.view(blocks, -1), width, columns * width, out_features, in_features)


def _raw_bytes(weight: SmallLinearWeight, size: int) -> torch.Tensor:
    """The first ``size`` bytes at the weight's memory, as uint8 (a view, not a copy)."""
    return torch.frombuffer((ctypes.c_uint8 * size).from_address(weight.data_ptr()), dtype=torch.uint8)


def onednn_view(packed: torch.Tensor, weight: torch.Tensor) -> SmallLinearWeight | None:
    """The kernel's view of ``packed``, oneDNN's packed copy of ``weight`` [N, K], where
    its bytes are ``pack_small_linear(weight, block, padded_k)``'s for some block and
    padding this build reads; else None."""
    if not (packed.is_mkldnn and weight.dtype == packed.dtype and small_linear_available(weight.dtype)):
        return None
    out_features, in_features = weight.shape
    size, itemsize = torch.ops.mkldnn._nbytes(packed), weight.dtype.itemsize
    for block in (64, 32, 16, 128):
        blocks = -(-out_features // block)
        if block % (2 * vector_width()) or size % (blocks * block * itemsize):
            continue
        padded_k = size // (blocks * block * itemsize)
        if padded_k < in_features or padded_k % (2 if weight.dtype == torch.bfloat16 else 1):
            continue
        ours = pack_small_linear(weight, block, padded_k)
        view = SmallLinearWeight(packed, block, ours.block_stride, out_features, in_features)
        if torch.equal(_raw_bytes(view, size), ours.storage.view(-1).view(torch.uint8)):
            return view
    return None


def small_linear(x: torch.Tensor, weight: SmallLinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] times the packed weight (+ bias [N]): [..., N] in x's dtype, which is the weight's."""
    # A decode step calls this for every linear: the library is looked up once a call.
    library = _library()
    assert x.dtype == weight.dtype and x.is_cpu, (x.dtype, weight.dtype, x.device)
    assert x.shape[-1] == weight.in_features, (x.shape, weight.in_features)
    assert weight.block % (2 * _vector_width(library)) == 0, weight.block  # layout: SmallLinearWeight
    flat = x if x.dim() == 2 else x.reshape(-1, weight.in_features)
    rows = flat.shape[0]
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    out = torch.empty(rows, weight.out_features, dtype=x.dtype)
    if bias is not None:
        if bias.dtype != torch.float32 or not bias.is_contiguous():
            bias = bias.detach().to(torch.float32).contiguous()
        assert bias.shape == (weight.out_features,), (bias.shape, weight.out_features)
    function = library.small_linear_f32 if x.dtype == torch.float32 else library.small_linear_bf16
    function(flat.data_ptr(), flat.stride(0), rows, weight.address, weight.block, weight.block_stride,
             None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), weight.out_features,
             weight.in_features, torch.get_num_threads())
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.out_features)


def small_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes: the float32 product (+ bias), rounded to x's dtype once."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
