"""Quantized linears that read the same input stacked into one: a decoder layer's query,
key and value projections, a gated MLP's gate and up, each group run as one kernel call
(one decode call, one prefill panel product, one per-token quantization of x) whose
output is split, as the bfloat16 CPU path runs one packed matmul per group.

A decode step's quantized products are small: each call pays its dispatch and reads its
weight cold, so one call streaming the group's weights back to back is cheaper than
two or three.

Invariants:
- ``stack_quantized`` builds one QuantizedLinear whose codes, scales, zero points and
  biases are the parts' concatenated along the output dimension, and points every part
  at its rows of them (views): the stacked weight replaces the parts' tensors, no second
  copy is kept, and each part still runs alone (the last layer's sampled rows project
  keys and values alone; a fallback forward calls the parts).
- Every output column is computed as the part's own call computes it: the decode
  kernels and the W8A8 kernel compute each column alone (bit for bit), a per-token
  input quantization depends on x only; a W8 per-tensor scale becomes the same value
  on each of the part's rows (per channel), which the kernels apply as they apply the
  per-tensor one.
- Parts stack only where they agree (``stack_refusal``): layout, input width, stored
  dtype, input scheme, act-order permutation, bias present or not, W8 block shape (each
  part but the last a whole number of block rows; per-tensor and per-channel scales mix,
  blocks do not mix with them), W8 and W4 zero points present or not, W4 group size. Others
  stay separate calls.
- Stacking runs in the CPU step (engine/surgery.py's PREPARATION_ORDER), after a
  tensor-parallel rank's shares were cut, so it stacks the shares.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from ..kernels.cpu_fused import fused_kernels_available, silu_mul
from ..surgery import called_on, probe_matches, replace, submodule
from .linear import QuantizedLinear

if TYPE_CHECKING:  # typing.TypeIs is Python 3.13's
    from typing_extensions import TypeIs

STACKED_DTYPES = (torch.float32, torch.bfloat16)


def _stored(layer: QuantizedLinear) -> torch.Tensor:
    stored = layer.weight if layer.layout == "w8" else layer.packed
    assert stored is not None, "a built QuantizedLinear holds its codes"
    return stored


def _w8_scale_kind(layer: QuantizedLinear) -> str:
    if layer.block is not None:
        return f"blocks {layer.block}"
    assert layer.scale is not None
    return "tensor" if layer.scale.numel() == 1 else "channel"


def stack_refusal(parts: Sequence[object]) -> str | None:
    """Why ``parts`` cannot run as one stacked QuantizedLinear (see the module
    docstring), or None where they can."""
    if len(parts) < 2 or not all(isinstance(part, QuantizedLinear) for part in parts):
        return "not all quantized linears"
    layers = [part for part in parts if isinstance(part, QuantizedLinear)]
    first = layers[0]
    agree = {
        "layout": lambda layer: layer.layout,
        "input width": lambda layer: layer.in_features,
        "stored dtype": lambda layer: _stored(layer).dtype,
        "device": lambda layer: _stored(layer).device,
        "input scheme": lambda layer: (layer.activations, layer.input_quantization),
        "bias present": lambda layer: layer.bias is None or layer.bias.dtype,
        "W4 group size and zero points": lambda layer: (layer.group_size, layer.zeros is None),
        "W8 block": lambda layer: layer.block,
        "W8 zero points present": lambda layer: layer.zero is None,
    }
    for what, key in agree.items():
        if len({key(layer) for layer in layers}) > 1:
            return f"their {what} differ ({', '.join(str(key(layer)) for layer in layers)})"
    perms = [layer.input_perm for layer in layers]
    if any(perm is not None for perm in perms) and not all(
            perm is not None and perms[0] is not None and torch.equal(perm, perms[0]) for perm in perms):
        return "their act-order permutations differ"
    if first.block is not None and any(layer.out_features % first.block[0] for layer in layers[:-1]):
        return f"a part's rows are not whole blocks of {first.block[0]}"
    return None


def _row_scale(layer: QuantizedLinear, scale: torch.Tensor | None = None) -> torch.Tensor:
    """A W8 layer's scale (or ``scale``: its zero points, of the same shape) with a row
    per output row ([N, 1]; blocks as they are)."""
    scale = layer.scale if scale is None else scale
    assert scale is not None
    if layer.block is None and scale.numel() == 1:
        return scale.reshape(1, 1).expand(layer.out_features, 1)
    return scale


def stack_quantized(parts: Sequence[QuantizedLinear]) -> QuantizedLinear:
    """One QuantizedLinear computing ``parts`` side by side (outputs in their order);
    each part is pointed at its rows of the stacked tensors (see the module docstring).
    The caller checked ``stack_refusal``."""
    assert stack_refusal(parts) is None, stack_refusal(parts)
    first = parts[0]
    bias = None if first.bias is None else torch.cat([part.bias for part in parts if part.bias is not None])
    if first.layout == "w8":
        zero = None if first.zero is None else torch.cat([_row_scale(part, part.zero) for part in parts])
        stacked = QuantizedLinear.w8(torch.cat([_stored(part) for part in parts]),
                                     torch.cat([_row_scale(part) for part in parts]), first.block, bias,
                                     first.input_perm, zero)
    else:
        zeros = None if first.zeros is None else torch.cat([part.zeros for part in parts if part.zeros is not None])
        stacked = QuantizedLinear.w4(torch.cat([_stored(part) for part in parts]),
                                     torch.cat([part.scales for part in parts if part.scales is not None]),
                                     zeros, first.group_size, first.input_perm, bias)
    for flag in ("activations", "input_quantization", "cpu_kernels", "int8_kernel", "use_reference"):
        setattr(stacked, flag, getattr(first, flag))
    _point_parts_at(stacked, parts)
    return stacked


def _point_parts_at(stacked: QuantizedLinear, parts: Sequence[QuantizedLinear]) -> None:
    """Each part's tensors become views of its rows of ``stacked``'s (its old ones freed)."""
    start = 0
    for part in parts:
        end = start + part.out_features
        if part.bias is not None:
            assert stacked.bias is not None
            part.bias = stacked.bias[start:end]
        if part.layout == "w8":
            assert stacked.weight is not None and stacked.scale is not None
            part.weight = stacked.weight[start:end]
            block_rows = 1 if stacked.block is None else stacked.block[0]
            part.scale = stacked.scale[start // block_rows:-(-end // block_rows)]
            part.zero = None if stacked.zero is None else stacked.zero[start // block_rows:-(-end // block_rows)]
        else:
            assert stacked.packed is not None and stacked.scales is not None
            part.packed, part.scales = stacked.packed[start:end], stacked.scales[start:end]
            part.zeros = None if stacked.zeros is None else stacked.zeros[start:end]
        part.input_perm = stacked.input_perm
        part.bound_decode = None
        start = end


def stacked_projection(parts: Sequence[object]) -> tuple[QuantizedLinear | None, str | None]:
    """(the stacked linear, None) for ``parts`` that stack, else (None, why not)."""
    refusal = stack_refusal(parts)
    if refusal is not None:
        return None, refusal
    return stack_quantized([part for part in parts if isinstance(part, QuantizedLinear)]), None


class QuantizedGatedMLP(Protocol):
    """What StackedGatedMLP reads of the MLP it replaces."""

    gate_proj: QuantizedLinear
    up_proj: QuantizedLinear
    down_proj: Callable[[torch.Tensor], torch.Tensor]
    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor, /) -> torch.Tensor: ...


class StackedGatedMLP(nn.Module):
    """A gated MLP, ``down(act(gate(x)) * up(x))``, whose quantized gate and up run as one
    stacked call, and SiLU times up through the fused kernel when ``silu_kernel``.
    ``mlp`` is the original module (its gate and up now views of ``gate_up``), whose
    forward runs with gradients on or another dtype."""

    mlp: QuantizedGatedMLP  # registered as a submodule; typed by what is read of it

    def __init__(self, mlp: QuantizedGatedMLP, gate_up: QuantizedLinear, silu_kernel: bool) -> None:
        super().__init__()
        self.mlp, self.gate_up, self.silu_kernel = mlp, gate_up, silu_kernel
        self.intermediate = gate_up.out_features // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden] -> [..., hidden]; gate and up are the two halves of one call's output.
        if torch.is_grad_enabled() or x.dtype not in STACKED_DTYPES:
            return self.mlp(x)
        gate_up = self.gate_up(x)
        if self.silu_kernel:  # one pass, no temporaries (kernels/cpu_fused.c)
            hidden = silu_mul(gate_up.view(-1, gate_up.shape[-1])).view(*x.shape[:-1], -1)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            hidden = self.mlp.act_fn(gate).mul_(up)
        return self.mlp.down_proj(hidden)


def _is_quantized_gated_mlp(module: object) -> TypeIs[QuantizedGatedMLP]:
    """Whether ``module`` is a gated MLP with quantized gate and up of one width."""
    modules = getattr(module, "_modules", {})
    gate, up = modules.get("gate_proj"), modules.get("up_proj")
    return (modules.get("down_proj") is not None and callable(getattr(module, "act_fn", None))
            and isinstance(gate, QuantizedLinear) and isinstance(up, QuantizedLinear)
            and gate.out_features == up.out_features)


def stack_gated_mlps(model: nn.Module, dtype: torch.dtype, silu_kernel: bool = True) -> int:
    """Replace every gated MLP of this CPU ``model`` (activations of ``dtype``) whose gate
    and up are quantized linears that stack by a StackedGatedMLP where it gives the
    MLP's own output on a probe input, SiLU through the fused kernel where
    ``silu_kernel`` and that reproduces ``act_fn``; returns how many were replaced. An
    MLP refused keeps its own forward over its parts, which still run alone (views of
    the stacked weight)."""
    if dtype not in STACKED_DTYPES:
        return 0
    targets = [(name, module) for name, module in model.named_modules() if _is_quantized_gated_mlp(module)
               and stack_refusal((module.gate_proj, module.up_proj)) is None
               and _stored(module.gate_proj).device.type == "cpu"]
    kernel = silu_kernel and fused_kernels_available(dtype)
    replaced = 0
    for name, mlp in targets:
        gate_up = stack_quantized((mlp.gate_proj, mlp.up_proj))
        probe = torch.randn(3, gate_up.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        candidates = (StackedGatedMLP(mlp, gate_up, silu_kernel=use_kernel)
                      for use_kernel in ((True, False) if kernel else (False,)))
        original = submodule(model, name)
        fused = next((candidate for candidate in candidates
                      if probe_matches(original, candidate, called_on(probe))), None)
        if fused is not None:
            replace(model, name, fused)
            replaced += 1
    return replaced
