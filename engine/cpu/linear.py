"""oneDNN matmuls for the CPU path: linears replaced by modules that run on a weight packed once.

torch's CPU ``nn.Linear`` calls MKL's sgemm. oneDNN's linear over a weight reordered
once into its blocked layout is often faster on the shapes a decoder runs (the
engine races the two on the model's shapes at load; bench/bench_engine.py prints
both peaks). ``PackedLinear`` replaces an
``nn.Linear`` in its parent: an ``nn.Linear`` itself, sharing the original weight and
bias (tied embeddings, LoRA wrappers and state dicts see the same parameters), plus
the packed copy, an opaque oneDNN tensor: on CPU the packed linear weights are held
twice. Where oneDNN's packed bytes are a layout the small-batch C kernel reads
(kernels/cpu_small_linear.py: AVX-512 hosts), the row counts at which that kernel
measures faster for the weight's shape (the engine's race, engine/cpu/linear_race.py)
run on it, over the same packed copy: it takes any number of rows without padding.

Only float32 and bfloat16 pack (oneDNN has no float64 matmul); float64 keeps torch's
exact-reference path. Where oneDNN reports no bfloat16 support (hosts without
AVX-512 BW/VL/DQ or AVX-NE-CONVERT), torch's own bfloat16 matmul is several times
slower than float32 there, so a bfloat16 linear can instead be packed as a float32
copy: its input is widened to float32, the product accumulates in float32 as
torch's bfloat16 matmul does, and the output is rounded back to bfloat16 once. That
copy costs twice the bfloat16 weight's memory. Whether the engine packs at all, and
in which dtype, is its CPU path choice (engine/cpu/paths.py), measured against
torch's matmul on the host.

Gated MLPs (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, the Llama family's)
run their gate and up projections as one matmul over both weights packed together,
one pass over the input instead of two, and SiLU
times up in one pass of the fused kernel (kernels/cpu_fused.c) when that reproduces
the module's ``act_fn``: ``FusedGatedMLP`` replaces such an MLP only if it gives the
MLP's own output on a probe input, so a model whose MLP differs keeps its own.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

from ..kernels.cpu_fused import fused_kernels_available, silu_mul
from ..kernels.cpu_small_linear import SmallLinearWeight, onednn_view, small_linear
from ..kernels.onednn_rows import by_row_parts, padded_rows
from ..surgery import called_on, probe_matches, replace
from .protocols import GatedMLP

if TYPE_CHECKING:  # typing.TypeIs is Python 3.13's
    from typing_extensions import TypeIs

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

# The row counts the small-batch kernel is raced at; a step's rows run as the
# smallest of these at or above them was measured, and more than the last on oneDNN.
KERNEL_ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)
# Which of KERNEL_ROW_COUNTS the small-batch kernel runs faster than oneDNN for a
# weight of this shape (out_features, in_features) and dtype: the engine's race
# (engine/cpu/linear_race.py), or all where forced on.
SmallKernelChoice = Callable[[int, int, torch.dtype], frozenset[int]]


@dataclass(frozen=True)
class KernelPacked:
    """oneDNN's packed weight and the small-batch kernel's view of the same memory,
    with the row counts (of KERNEL_ROW_COUNTS) the kernel runs."""

    onednn: torch.Tensor
    kernel: SmallLinearWeight
    kernel_rows: frozenset[int]

    @property
    def dtype(self) -> torch.dtype:
        return self.onednn.dtype

    def takes(self, rows: int) -> bool:
        return rows in self._rows_taken

    @functools.cached_property
    def _rows_taken(self) -> frozenset[int]:
        """Every row count the kernel runs: those measured as (the next of
        KERNEL_ROW_COUNTS from them) one of ``kernel_rows``; a set, since every linear
        call asks."""
        return frozenset(rows for rows in range(KERNEL_ROW_COUNTS[-1] + 1)
                         if next(count for count in KERNEL_ROW_COUNTS if count >= rows) in self.kernel_rows)


# A packed weight: oneDNN's (an opaque tensor), with the kernel's view where it has one.
PackedWeight = torch.Tensor | KernelPacked


def pack_weight(weight: torch.Tensor, rows_hint: int, small_kernel: SmallKernelChoice | None) -> PackedWeight:
    """``weight`` [out, in] packed once by oneDNN for ``rows_hint`` rows, with the
    small-batch kernel's view of it where the kernel reads its layout and
    ``small_kernel`` takes some row counts for its shape."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
    view = onednn_view(packed, weight) if small_kernel is not None else None
    if view is None or small_kernel is None:
        return packed
    rows = small_kernel(weight.shape[0], weight.shape[1], weight.dtype)
    return KernelPacked(packed, view, rows) if rows else packed


@functools.cache
def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build runs oneDNN's packed linear in ``dtype`` on this CPU:
    oneDNN's own support query (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT),
    then a probe that must give torch's own answer."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        x = torch.arange(16, dtype=torch.float32).view(2, 8).to(dtype)
        weight = torch.ones(4, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 2)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.equal(out, nn.functional.linear(x, weight)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class PackedLinear(nn.Linear):
    """An nn.Linear run by oneDNN on a copy of its weight packed once for ``rows_hint``
    rows (any row count runs on it), in ``packed_dtype`` (the weight's own by default;
    float32 for a bfloat16 weight where oneDNN has no bfloat16). With gradients on,
    or an input of another dtype, torch's own linear runs: autograd does not see
    through the packed copy."""

    packed_weight: PackedWeight  # not a parameter: state dicts leave it out
    packed_bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, rows_hint: int, packed_dtype: torch.dtype | None = None,
                 small_kernel: SmallKernelChoice | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same parameters
        self.register_parameter("bias", linear.bias)
        packed_dtype = packed_dtype or linear.weight.dtype
        self.small_kernel = small_kernel  # read again where its weight is packed side by side with others
        self.packed_weight = pack_weight(linear.weight.detach().to(packed_dtype), rows_hint, small_kernel)
        self.packed_bias = None if linear.bias is None else linear.bias.detach().to(packed_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if _needs_torch(x, self.weight):
            return nn.functional.linear(x, self.weight, self.bias)
        return packed_matmul(x, self.packed_weight, self.packed_bias)

    def unpacked(self) -> nn.Linear:
        """A plain nn.Linear on the same parameters, for a linear whose packed copy is
        no longer read (its weights went into a wider packed matmul)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear


def pack_linears(model: nn.Module, rows_hint: int, dtypes: tuple[torch.dtype, ...] = PACKABLE_DTYPES,
                 packed_dtype: torch.dtype | None = None, small_kernel: SmallKernelChoice | None = None) -> int:
    """Replace every CPU nn.Linear of ``model`` whose weight is of one of ``dtypes`` by
    a PackedLinear, where oneDNN runs that dtype here; returns how many were replaced.
    With ``packed_dtype``, the packed copies are of that dtype instead (float32 copies
    of bfloat16 linears), where oneDNN runs it. ``small_kernel`` says which shapes the
    small-batch kernel runs instead (see ``pack_weight``).

    ``rows_hint`` is the number of rows oneDNN tunes the packed layout for; any number
    of rows runs on it.
    """
    if packed_dtype is not None:
        dtypes = dtypes if onednn_linear_available(packed_dtype) else ()
    else:
        dtypes = tuple(dtype for dtype in dtypes if onednn_linear_available(dtype))
    targets = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype not in dtypes:
            continue
        if module.bias is None or module.bias.dtype == weight.dtype:
            targets.append((name, module))
    for name, module in targets:
        replace(model, name, PackedLinear(module, rows_hint, packed_dtype, small_kernel))
    return len(targets)


def _needs_torch(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype != weight.dtype or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def packed_matmul(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times a packed weight (and bias, of the packed weight's dtype):
    [..., out] in x's dtype, computed in the packed weight's."""
    # A decode step calls this for every linear, mostly on 2-D x of the packed dtype:
    # no reshapes or casts there.
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = by_row_parts(flat, lambda part: _rows_matmul(part, packed, bias))
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def _rows_matmul(flat: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """flat [rows, in] (any dtype) times a packed weight: [rows, out] in the packed weight's dtype."""
    rows = flat.shape[0]
    if isinstance(packed, KernelPacked):
        if packed.takes(rows):  # no padding
            return small_linear(flat if flat.dtype == packed.dtype else flat.to(packed.dtype), packed.kernel, bias)
        packed = packed.onednn
    return onednn_linear(padded_rows(flat, packed.dtype), packed, bias)[:rows]


def onednn_linear(flat: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear: flat [rows, in] times its packed weight (+ bias), [rows, out]."""
    return torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")


class FusedGatedMLP(nn.Module):
    """A gated MLP, ``down(act(gate(x)) * up(x))``, with gate and up as one matmul over
    both weights packed side by side, and SiLU times up through the fused kernel when
    ``silu_kernel``. ``mlp`` is the original module, whose projections it reads."""

    mlp: GatedMLP  # registered as a submodule; typed by what is read of it
    packed_gate_up: PackedWeight

    def __init__(self, mlp: GatedMLP, rows_hint: int, silu_kernel: bool) -> None:
        super().__init__()
        self.mlp = mlp
        projections = (mlp.gate_proj, mlp.up_proj)
        assert packable_side_by_side(projections), "a gated MLP's gate and up are packed alike (_is_gated_mlp)"
        self.packed_gate_up, _ = pack_side_by_side(projections, rows_hint)
        self.silu_kernel = silu_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden] -> [..., hidden]; gate and up are the two halves of one matmul's output.
        mlp = self.mlp
        if _needs_torch(x, mlp.gate_proj.weight):
            gate, up = nn.functional.linear(x, mlp.gate_proj.weight), nn.functional.linear(x, mlp.up_proj.weight)
            return mlp.down_proj(mlp.act_fn(gate) * up)
        gate_up = packed_matmul(x, self.packed_gate_up, None)
        if self.silu_kernel:  # one pass, no temporaries (kernels/cpu_fused.c)
            return mlp.down_proj(silu_mul(gate_up.view(-1, gate_up.shape[-1])).view(*x.shape[:-1], -1))
        gate, up = gate_up.split(mlp.gate_proj.out_features, dim=-1)
        return mlp.down_proj(mlp.act_fn(gate).mul_(up))


def _is_gated_mlp(module: object) -> TypeIs[GatedMLP]:
    """Whether ``module`` is a gated MLP whose three projections are packed, gate and
    up alike and without biases."""
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    return (isinstance(gate, PackedLinear) and isinstance(up, PackedLinear)
            and isinstance(getattr(module, "down_proj", None), PackedLinear)
            and callable(getattr(module, "act_fn", None)) and gate.bias is None and up.bias is None
            and gate.weight.shape == up.weight.shape and gate.weight.dtype == up.weight.dtype)


def fuse_gated_mlps(model: nn.Module, rows_hint: int, silu_kernel: bool = True) -> int:
    """Replace every gated MLP whose projections are packed by a FusedGatedMLP where it
    reproduces the MLP's output on a probe input, with SiLU through the fused kernel
    when ``silu_kernel`` and that reproduces ``act_fn``; returns how many were fused."""
    modules: list[tuple[str, nn.Module]] = list(model.named_modules())
    targets = [(name, module) for name, module in modules if _is_gated_mlp(module)]
    num_fused = 0
    for name, mlp in targets:
        gate = mlp.gate_proj
        probe = torch.randn(3, gate.in_features, dtype=gate.weight.dtype, generator=torch.Generator().manual_seed(0))
        kernel = silu_kernel and fused_kernels_available(gate.weight.dtype)
        candidates = (FusedGatedMLP(mlp, rows_hint, silu_kernel=use_kernel)
                      for use_kernel in ((True, False) if kernel else (False,)))
        fused = next((candidate for candidate in candidates
                      if probe_matches(mlp, candidate, called_on(probe))), None)
        if fused is None:
            logger.info("%s does not compute down(act(gate(x)) * up(x)); its MLP stays unfused", type(mlp).__name__)
            continue
        for projection_name, projection in (("gate_proj", mlp.gate_proj), ("up_proj", mlp.up_proj)):
            # Their packed copies are no longer read: the pair's is.
            assert isinstance(projection, PackedLinear), "a gated MLP's projections are packed (_is_gated_mlp)"
            replace(mlp, projection_name, projection.unpacked())
        replace(model, name, fused)
        num_fused += 1
    return num_fused


def packable_side_by_side(linears: tuple[object, ...]) -> TypeGuard[tuple[PackedLinear, ...]]:
    """Whether ``pack_side_by_side`` takes these: packed linears of one input size and
    dtype, each with a bias or none with one."""
    packed = [linear for linear in linears if isinstance(linear, PackedLinear)]
    return (len(packed) == len(linears)
            and len({(linear.in_features, linear.weight.dtype, linear.packed_weight.dtype, linear.bias is None)
                     for linear in packed}) == 1)


def pack_side_by_side(linears: tuple[PackedLinear, ...], rows_hint: int) -> tuple[PackedWeight, torch.Tensor | None]:
    """One packed weight, and bias or None, that computes all of ``linears`` (see
    ``packable_side_by_side``) on the same input in one matmul, their outputs side by
    side in the given order."""
    assert packable_side_by_side(linears)
    packed_dtype = linears[0].packed_weight.dtype  # the dtype the linears were packed in
    biases = [linear.bias for linear in linears]
    weight = torch.cat([linear.weight.detach() for linear in linears]).to(packed_dtype)
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases]).to(packed_dtype)
    return pack_weight(weight, rows_hint, linears[0].small_kernel), bias
