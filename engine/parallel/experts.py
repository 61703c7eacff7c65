"""Quantized MoE experts (engine/quantization/experts.py's QuantizedExperts) split over
tensor-parallel ranks with their scales.

As the float experts split (engine/parallel/sharding.py's ``split_experts``), every rank
routes every token and computes each expert over its share of the intermediate size;
the experts' outputs are summed over ranks (ReducedOutput). A rank keeps:
- gate_up: the output rows of its intermediate share, with their scales (MXFP4: gpt-oss
  interleaves gate and up rows, so rows [2 * start, 2 * end); per-expert W8/W4: the
  share's rows of the gate half and of the up half);
- down: the input columns of its share, with the scale columns of their blocks or
  groups (MXFP4: whole 32-element blocks);
- gate_up's bias rows of its share; down's bias on rank 0 only (added once to the sum).

The intermediate size is dealt out in whole units, a unit being the least common
multiple of gate_up's row block and down's column block or group (MXFP4: 32; FP8 in
128x128 blocks: 128; per-channel scales: 1; packed 4-bit: at least 2), as evenly as the
units allow (the first ranks one more where they do not divide), so no scale block or
group straddles two ranks' shares.

Invariants:
- A rank's share dequantizes to exactly the rows (gate_up) and columns (down) of the
  whole experts' dequantized weights that its intermediate share takes; no scale is
  recomputed.
- ``expert_share`` is the one rule for a rank's share: the split and the slice loading
  (engine/parallel/loading.py) both ask it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..quantization.experts import LinearsPerExpert, QuantizedExperts, stack_w8
from ..quantization.linear import QuantizedLinear
from ..quantization.mxfp4 import MXFP4_BLOCK, Mxfp4ExpertWeights
from .group import RankGroup, ShardingError
from .layers import ReducedOutput
from .quantized import column_quantized, row_quantized


def expert_share(intermediate: int, unit: int, group: RankGroup, name: str) -> tuple[int, int]:
    """[start, end) of the experts' ``intermediate`` size this rank keeps: whole units of
    ``unit`` (the last possibly partial), dealt out as evenly as they allow.
    ShardingError, naming the module, where there are fewer units than ranks."""
    units = -(-intermediate // unit)
    if units < group.size:
        raise ShardingError(f"{name}: its experts' intermediate size {intermediate} holds {units} quantization "
                            f"blocks of {unit}, fewer than the {group.size} ranks; it is not split over these ranks")
    base, extra = divmod(units, group.size)
    first = group.rank * base + min(group.rank, extra)
    count = base + (1 if group.rank < extra else 0)
    return first * unit, min((first + count) * unit, intermediate)


def split_quantized_experts(module: QuantizedExperts, name: str, group: RankGroup) -> ReducedOutput:
    """This rank's share of ``module`` (see the module docstring), its output summed over
    ranks. ShardingError, naming the tensor, where a share would cut a block or group."""
    gate_up, down = module.gate_up, module.down
    if isinstance(gate_up, Mxfp4ExpertWeights) and isinstance(down, Mxfp4ExpertWeights):
        start, end = expert_share(down.in_features, MXFP4_BLOCK, group, name)
        new_gate_up = _mxfp4_part(gate_up, slice(None), slice(2 * start, 2 * end))
        new_down = _mxfp4_part(down, slice(start // MXFP4_BLOCK, -(-end // MXFP4_BLOCK)), slice(None))
        gate_up_bias = None if module.gate_up_bias is None else module.gate_up_bias[:, 2 * start: 2 * end]
    elif isinstance(gate_up, LinearsPerExpert) and isinstance(down, LinearsPerExpert):
        unit = math.lcm(*(_row_unit(linear) for linear in _linears(gate_up)),
                        *(_column_unit(linear) for linear in _linears(down)))
        start, end = expert_share(down.in_features, unit, group, name)
        new_gate_up = _column_linears(gate_up, f"{name}.gate_up", start, end)
        new_down = _row_linears(down, f"{name}.down", start, end)
        gate_up_bias = None if module.gate_up_bias is None else _gate_up_rows(module.gate_up_bias, start, end)
    else:
        raise ShardingError(f"{name}: quantized experts holding {type(gate_up).__name__} and {type(down).__name__} "
                            "are not split over ranks")
    down_bias = module.down_bias if group.rank == 0 else None
    part = QuantizedExperts(new_gate_up, new_down, module.activation, _contiguous(gate_up_bias), down_bias)
    part.use_reference = module.use_reference
    return ReducedOutput(part, group)


def _contiguous(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.contiguous()


def _mxfp4_part(weights: Mxfp4ExpertWeights, blocks: slice, rows: slice) -> Mxfp4ExpertWeights:
    """``weights``' output ``rows`` and input ``blocks`` of 32 elements, every expert."""
    part = Mxfp4ExpertWeights(weights.blocks[:, rows, blocks], weights.scales[:, rows, blocks])
    part.use_reference, part.cpu_kernels = weights.use_reference, weights.cpu_kernels
    return part


def _linears(projection: LinearsPerExpert) -> list[QuantizedLinear]:
    return [linear for linear in projection.modules() if isinstance(linear, QuantizedLinear)]


def _row_unit(linear: QuantizedLinear) -> int:
    """Output rows a column share of ``linear`` must keep together."""
    return linear.block[0] if linear.layout == "w8" and linear.block is not None else 1


def _column_unit(linear: QuantizedLinear) -> int:
    """Input columns a row share of ``linear`` must keep together (a block, a group,
    or the byte of two packed 4-bit codes)."""
    if linear.layout == "w8":
        return linear.block[1] if linear.block is not None else 1
    return 2 if linear.group_size == linear.in_features else math.lcm(2, linear.group_size)


def _parts(projection: LinearsPerExpert) -> dict[str, list[QuantizedLinear]]:
    """The projection's parts (side by side in its output), each a linear per expert."""
    parts: dict[str, list[QuantizedLinear]] = {}
    for part_name, experts in projection.parts.items():
        assert isinstance(experts, nn.ModuleDict), type(experts)
        linears = [experts[str(expert)] for expert in range(projection.num_experts)]
        assert all(isinstance(linear, QuantizedLinear) for linear in linears), part_name
        parts[part_name] = [linear for linear in linears if isinstance(linear, QuantizedLinear)]
    return parts


def _gate_up_rows(rows: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The share [start, end) of the gate half and of the up half of ``rows`` [..., 2I]."""
    half = rows.shape[-1] // 2
    return torch.cat([rows[..., start:end], rows[..., half + start: half + end]], dim=-1)


def _column_linears(projection: LinearsPerExpert, name: str, start: int, end: int) -> LinearsPerExpert:
    """gate_up's rows of the share [start, end) of each half (gate, then up), mapped
    onto its parts side by side (gate and up apart, or stacked together)."""
    half = projection.out_features // 2
    wanted = ((start, end), (half + start, half + end))
    parts: dict[str, list[QuantizedLinear]] = {}
    offset = 0
    for part_name, linears in _parts(projection).items():
        rows = linears[0].out_features
        local = [(max(low, offset) - offset, min(high, offset + rows) - offset) for low, high in wanted
                 if max(low, offset) < min(high, offset + rows)]
        if local:
            parts[part_name] = [column_quantized(linear, f"{name}.{expert}.{part_name}", local)
                                for expert, linear in enumerate(linears)]
        offset += rows
    return stack_w8(parts)


def _row_linears(projection: LinearsPerExpert, name: str, start: int, end: int) -> LinearsPerExpert:
    """down's input columns [start, end) of every expert's linears."""
    parts: dict[str, list[QuantizedLinear]] = {}
    for part_name, linears in _parts(projection).items():
        split = []
        for expert, linear in enumerate(linears):
            label = f"{name}.{expert}.{part_name}"
            if linear.input_quantization != "none":
                raise ShardingError(f"{label}: its inputs are quantized per token ({linear.input_quantization}, a "
                                    "W8A8 checkpoint) with a scale from the whole row, which a rank's share of the "
                                    "input columns does not see; the experts are not split over these ranks")
            if linear.bias is not None:
                raise ShardingError(f"{label}: a biased expert projection split by its input is not split over ranks")
            split.append(row_quantized(linear, label, start, end))
        parts[part_name] = split
    return stack_w8(parts)
