"""MoE experts split over tensor-parallel ranks: transformers' float experts modules
(``split_float_experts``) and quantized ones (engine/quantization/experts.py's
QuantizedExperts, with their scales).

Every rank routes every token and computes each expert over its share of the
intermediate size; the experts' outputs are summed over ranks (ReducedOutput). Float
experts keep their own module and forward, holding the rank's share of each weight in
the layout transformers gives it (``FloatExpertsLayout``: gate_up [E, 2I, H] or,
transposed, [E, H, 2I], its gate and up outputs as two halves or interleaved pairs;
down [E, H, I] or [E, I, H]; biases [E, 2I] and [E, H]); down's bias is kept on rank 0
and zero on the others, so the sum adds it once. A quantized experts' rank keeps:
- gate_up: the output rows of its intermediate share, with their scales (MXFP4: gpt-oss
  interleaves gate and up rows, so rows [2 * start, 2 * end); per-expert W8/W4: the
  share's rows of the gate half and of the up half);
- down: the input columns of its share, with the scale columns of their blocks or
  groups (MXFP4: whole 32-element blocks); W8A8 experts' down quantizes each expert's
  input with the whole row's per-token scale (RowShareExperts);
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

import dataclasses
import math

import torch
from torch import nn

from ..quantization.activations import InputQuantization, fake_quantize_with_scales, scales_from_absmax
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
        raise ShardingError(f"{name}: its experts' intermediate size {intermediate} holds {units} whole units of "
                            f"{unit} (scale blocks, or 8 for float experts), fewer than the {group.size} ranks; it is "
                            "not split over these ranks")
    base, extra = divmod(units, group.size)
    first = group.rank * base + min(group.rank, extra)
    count = base + (1 if group.rank < extra else 0)
    return first * unit, min((first + count) * unit, intermediate)


# Float experts modules split though the model's tensor-parallel plan names none (gpt-oss's
# plan leaves its experts out), by class name.
UNNAMED_FLOAT_EXPERTS = ("GptOssExperts",)
# Float experts' intermediate size is dealt out in whole units of 8, so every rank's rows
# stay 16-byte aligned in bfloat16 (transformers' grouped matmul refuses other strides).
FLOAT_EXPERTS_UNIT = 8
# The marker of a quantized experts module already read as this rank's share
# (engine/parallel/quantized_slices.py): the split wraps it as it is.
RANK_SHARE = "rank_share"


@dataclasses.dataclass(frozen=True)
class FloatExpertsLayout:
    """How a float experts module holds its weights (the attributes transformers'
    ``use_experts_implementation`` sets): ``transposed`` gate_up [E, H, 2I] and down
    [E, I, H] (else [E, 2I, H], [E, H, I]); ``interleaved`` gate and up outputs in
    alternating pairs (else the gate half, then the up half); ``biased`` with
    gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]."""

    transposed: bool
    interleaved: bool
    biased: bool

    @property
    def dims(self) -> tuple[int, int]:
        """(gate_up's output dimension, down's input dimension)."""
        return (2, 1) if self.transposed else (1, 2)

    def gate_up_ranges(self, intermediate: int, start: int, end: int) -> Ranges:
        """gate_up's outputs (and bias entries) of the intermediate share [start, end)."""
        if self.interleaved:
            return ((2 * start, 2 * end),)
        return (start, end), (intermediate + start, intermediate + end)


def float_experts_layout(module: nn.Module) -> FloatExpertsLayout | None:
    """``module``'s layout if it is a float experts module the ranks split exactly
    (gated, no norm after each expert, gate_up twice down's intermediate size); None
    otherwise."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and getattr(module, "has_gate", True)
            and not getattr(module, "has_post_expert_norm", False)):
        return None
    biased = bool(getattr(module, "has_bias", False))
    if biased and not all(isinstance(getattr(module, bias, None), nn.Parameter)
                          for bias in ("gate_up_proj_bias", "down_proj_bias")):
        return None
    layout = FloatExpertsLayout(bool(getattr(module, "is_transposed", False)),
                                not getattr(module, "is_concatenated", True), biased)
    gate_up_dim, down_dim = layout.dims
    return layout if gate_up.shape[gate_up_dim] == 2 * down.shape[down_dim] else None


def splits_unnamed(module: nn.Module) -> bool:
    """Whether the ranks split ``module`` as experts though no plan names it: quantized
    experts, and the float experts of ``UNNAMED_FLOAT_EXPERTS`` in a layout split exactly."""
    if isinstance(module, QuantizedExperts):
        return True
    return type(module).__name__ in UNNAMED_FLOAT_EXPERTS and float_experts_layout(module) is not None


Ranges = tuple[tuple[int, int], ...]  # [start, end) ranges along one dimension, joined


def float_expert_cuts(module: nn.Module, name: str, group: RankGroup) -> dict[str, tuple[int, Ranges]]:
    """(dimension, ranges) of each weight of float experts ``module`` this rank keeps,
    by parameter name (down's bias absent: kept whole); {} for a module not split."""
    layout = float_experts_layout(module)
    if layout is None:
        return {}
    gate_up_dim, down_dim = layout.dims
    down = module.down_proj
    assert isinstance(down, torch.Tensor), name
    intermediate = int(down.shape[down_dim])
    start, end = expert_share(intermediate, FLOAT_EXPERTS_UNIT, group, name)
    ranges = layout.gate_up_ranges(intermediate, start, end)
    cuts = {"gate_up_proj": (gate_up_dim, ranges), "down_proj": (down_dim, ((start, end),))}
    if layout.biased:
        cuts["gate_up_proj_bias"] = (1, ranges)
    return cuts


def split_float_experts(module: nn.Module, name: str, group: RankGroup) -> ReducedOutput:
    """The float experts ``module`` holding this rank's share of its intermediate size
    (``float_expert_cuts``), down's bias zero on every rank but 0, its output summed over
    ranks. ShardingError, naming it, for a layout not split exactly."""
    cuts = float_expert_cuts(module, name, group)
    if not cuts:
        raise ShardingError(f"{name}: {type(module).__name__} is not an expert layout the ranks split (gated "
                            "gate_up_proj twice down_proj's intermediate size, no norm after each expert)")
    for parameter_name, (dim, ranges) in cuts.items():
        whole = getattr(module, parameter_name).detach()
        part = torch.cat([whole.narrow(dim, start, end - start) for start, end in ranges], dim=dim)
        setattr(module, parameter_name, nn.Parameter(part.contiguous(), requires_grad=False))
    down_bias = getattr(module, "down_proj_bias", None)
    if "gate_up_proj_bias" in cuts and group.rank and isinstance(down_bias, nn.Parameter):
        module.down_proj_bias = nn.Parameter(torch.zeros_like(down_bias), requires_grad=False)
    share = cuts["down_proj"][1][0]
    for attribute in ("intermediate_size", "intermediate_dim"):  # plain ints some experts modules keep
        if isinstance(module.__dict__.get(attribute), int):
            module.__dict__[attribute] = share[1] - share[0]
    return ReducedOutput(module, group)


def split_quantized_experts(module: QuantizedExperts, name: str, group: RankGroup) -> ReducedOutput:
    """This rank's share of ``module`` (see the module docstring), its output summed over
    ranks. ShardingError, naming the tensor, where a share would cut a block or group.
    A module already read as this rank's share (``RANK_SHARE``) is wrapped as it is."""
    if getattr(module, RANK_SHARE, False):
        return ReducedOutput(module, group)
    gate_up, down = module.gate_up, module.down
    if isinstance(gate_up, Mxfp4ExpertWeights) and isinstance(down, Mxfp4ExpertWeights):
        start, end = expert_share(down.in_features, MXFP4_BLOCK, group, name)
        new_gate_up = _mxfp4_part(gate_up, slice(None), slice(2 * start, 2 * end))
        new_down = _mxfp4_part(down, slice(start // MXFP4_BLOCK, -(-end // MXFP4_BLOCK)), slice(None))
        gate_up_bias = None if module.gate_up_bias is None else module.gate_up_bias[:, 2 * start: 2 * end]
    elif isinstance(gate_up, LinearsPerExpert) and isinstance(down, LinearsPerExpert):
        unit = share_unit(_linears(gate_up), _linears(down))
        start, end = expert_share(down.in_features, unit, group, name)
        new_gate_up = _column_linears(gate_up, f"{name}.gate_up", start, end)
        new_down = _row_linears(down, f"{name}.down", start, end, group)
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


def share_unit(gate_up: list[QuantizedLinear], down: list[QuantizedLinear]) -> int:
    """The intermediate size's unit of per-expert linears: no share cuts gate/up's row
    blocks nor down's column blocks, groups or packed bytes."""
    return math.lcm(*(_row_unit(linear) for linear in gate_up), *(_column_unit(linear) for linear in down))


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


def _row_linears(projection: LinearsPerExpert, name: str, start: int, end: int,
                 group: RankGroup) -> LinearsPerExpert:
    """down's input columns [start, end) of every expert's linears (W8A8 ones as a
    RowShareExperts, quantizing their inputs with the whole row's scale)."""
    parts: dict[str, list[QuantizedLinear]] = {}
    for part_name, linears in _parts(projection).items():
        split = []
        for expert, linear in enumerate(linears):
            label = f"{name}.{expert}.{part_name}"
            if linear.bias is not None:
                raise ShardingError(f"{label}: a biased expert projection split by its input is not split over ranks")
            split.append(row_quantized(linear, label, start, end))
        parts[part_name] = split
    stacked = stack_w8(parts)
    return RowShareExperts(stacked, group) if stacked.parts_quantize_inputs() else stacked


class RowShareExperts(LinearsPerExpert):
    """down's share of W8A8 experts (inputs quantized per token, int8 or fp8): each
    expert's input row is quantized with one scale from the whole row's max|x|, the max
    over ranks of each rank's max over its columns, as a dense row share does
    (quantized.py's RowParallelQuantized); its linears multiply the codes as given.
    Every rank routes every token alike, so the ranks gather each expert's maxima in
    the same order."""

    def __init__(self, projection: LinearsPerExpert, group: RankGroup) -> None:
        parts = _parts(projection)
        super().__init__(parts)
        self.stacked_weight, self.stacked_scale = projection.stacked_weight, projection.stacked_scale
        self.stacked_block = projection.stacked_block
        self.input_quantization: InputQuantization = next(iter(parts.values()))[0].input_quantization
        for linear in _linears(self):
            linear.input_quantization, linear.activations = "none", "none"
        self.group = group

    def parts_quantize_inputs(self) -> bool:
        return True

    def matmul(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K / size], this rank's columns of expert ``expert``'s input.
        amax = self.group.all_gather(x.abs().amax(dim=-1, keepdim=True).double())  # [T, size], exact
        scales = scales_from_absmax(amax.amax(dim=-1, keepdim=True).to(x.dtype), self.input_quantization)
        return super().matmul(expert, fake_quantize_with_scales(x, scales, self.input_quantization))
