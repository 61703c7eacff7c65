"""Launcher of the small-batch linear for the CPU path (cpu_small_linear.c), beside its
plain-torch reference: out = x @ w.T (+ bias) for float32 or bfloat16 x and weight.

The weight is repacked once (``pack_small_linear``) into blocks of ``block_width()``
outputs by K, in which a tile of rows of x reads each block's weights as one
stream; the packed copy is what the caller keeps in place of a oneDNN one. Sums
run in float32 in the kernel's own order (bfloat16 outputs rounded once), as
oneDNN's and torch's float32-accumulating products do in theirs.
``small_linear_available(dtype)`` says whether the library built here and takes the
dtype; without it the callers keep oneDNN.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .native import NativeLibrary, declare

SOURCE = Path(__file__).with_name("cpu_small_linear.c")
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGTYPES = [_P, _I, _I, _P, _P, _P, _I, _I, _I, _N]


def _declare(library: ctypes.CDLL) -> None:
    declare(library, [f"small_linear_{suffix}" for suffix in _SUFFIXES.values()], _ARGTYPES, None)
    declare(library, ["small_linear_block", "small_linear_dot_bf16"], [], ctypes.c_int)


_LIBRARY = NativeLibrary(SOURCE, _declare, "linears stay on oneDNN")


def small_linear_available(dtype: torch.dtype) -> bool:
    return dtype in _SUFFIXES and _LIBRARY.load() is not None


def _library() -> ctypes.CDLL:
    library = _LIBRARY.load()
    assert library is not None, "call small_linear_available first"
    return library


def block_width() -> int:
    """Outputs per packed block in this build (two vectors of the target's width)."""
    return int(_library().small_linear_block())


@dataclass(frozen=True)
class SmallLinearWeight:
    """A weight [out_features, in_features] packed for the kernel (see cpu_small_linear.c):
    float32 [NB, K, BN] or bfloat16 [NB, ceil(K / 2), BN, 2], zero past the weight."""

    packed: torch.Tensor
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype


def pack_small_linear(weight: torch.Tensor) -> SmallLinearWeight:
    """``weight`` [N, K] (float32 or bfloat16, on the CPU) in the kernel's layout."""
    assert weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype in _SUFFIXES, (
        weight.shape, weight.device, weight.dtype)
    out_features, in_features = weight.shape
    width = block_width()
    blocks = -(-out_features // width)
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    columns = -(-in_features // pair) * pair
    padded = weight.detach().new_zeros(blocks * width, columns)
    padded[:out_features, :in_features] = weight.detach()
    # [NB, BN, K / pair, pair] -> [NB, K / pair, BN, pair]
    packed = padded.view(blocks, width, columns // pair, pair).transpose(1, 2).contiguous()
    return SmallLinearWeight(packed if pair == 2 else packed.view(blocks, columns, width), out_features, in_features)


def small_linear(x: torch.Tensor, weight: SmallLinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] times the packed weight (+ bias [N]): [..., N] in x's dtype, which is the weight's."""
    assert x.dtype == weight.dtype and x.device.type == "cpu", (x.dtype, weight.dtype, x.device)
    assert x.shape[-1] == weight.in_features, (x.shape, weight.in_features)
    assert weight.packed.is_contiguous()
    rows = x.numel() // weight.in_features
    flat = x.reshape(rows, weight.in_features)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    out = torch.empty(rows, weight.out_features, dtype=x.dtype)
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
        assert bias.shape == (weight.out_features,), (bias.shape, weight.out_features)
    function = getattr(_library(), f"small_linear_{_SUFFIXES[x.dtype]}")
    function(flat.data_ptr(), flat.stride(0), rows, weight.packed.data_ptr(),
             None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), weight.out_features,
             weight.in_features, torch.get_num_threads())
    return out.view(*x.shape[:-1], weight.out_features)


def small_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes: the float32 product (+ bias), rounded to x's dtype once."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
