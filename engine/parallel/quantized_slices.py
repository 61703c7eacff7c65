"""A tensor-parallel rank reads only its share of a quantized checkpoint's linears.

Each split linear's stored tensors (weight and scales, packed codes, zero points,
asymmetric int8's zero points with their scale) are
read through safetensors' ``get_slice`` as the part holding the rank's output rows (a
column split) or input columns (a row split), and handed to the checkpoint format's own
reader (engine/quantization/formats.py) with the share's shape: the reader checks and
converts them as it does a whole linear, and its QuantizedLinear is the share that
engine/parallel/quantized.py would cut from the whole one.

``QUANTIZED_AXES`` says, per on-disk layout and tensor, which axis holds the output rows
and which the input columns, and how many rows or columns one index along it covers (a
word of packed codes, a scale block or group). A cut must start on such a boundary and
end on one (or at the end); where it does not (a share cutting a block or a packed
word), where a row split meets act-order columns (``g_idx``) or a scale of one group per
row, or where the linear is not a plain split one (inside a recurrent mixer, online
quantization), the linear is read whole before the split, as without slices, and the
sharding step splits it (or refuses it, naming it).

Quantized MoE experts are read the same way before the split (``put_expert_shares``):
the loader leaves them on the meta device for a rank, and the checkpoint's own experts
reader reads the rank's share of the intermediate size (MXFP4's whole 32-element
blocks; per-expert FP8, INT8 and INT4 linears' rows and columns in whole blocks, groups
and words). The checkpoint's float tensors the ranks split (embedding, LM head, float
linears) are read as slices by engine/parallel/loading.py's ``quantized_splits``.

Invariant: a slice-read share and the share split from the whole linear (or experts)
dequantize to the same weight (tests/engine/parallel/test_tp_loading_quantized.py).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..lora.layers import SHARE_ATTRIBUTE
from ..quantization.checkpoint import CheckpointTensors
from ..quantization.experts import (
    QuantizedExperts,
    checkpoint_prefixes,
    experts_modules,
    per_expert_names,
    replace_quantized_experts,
)
from ..quantization.formats import read_quantized_linear, stored_quantized
from ..quantization.load import QuantizedWeights
from ..quantization.mxfp4 import MXFP4_BLOCK
from ..quantization.scheme import QuantScheme
from ..surgery import replace
from .experts import RANK_SHARE, expert_share, share_unit
from .group import RankGroup
from .layers import RowParallelLinear
from .loading import Cut, slice_plan
from .quantized import RowParallelQuantized

# (output axis, rows per index, input axis, columns per index) of each stored tensor by
# on-disk layout; None: the tensor has no such axis (read whole along it). "group" and
# "block" stand for the scheme's group size and block sides, "word" for codes per int32
# (8 of 4 bits, 4 of 8 bits: pack-quantized W8A16 packs its codes along the input and its
# zero points along the output rows in words of 4). A scale of one group per row (no
# group size) has no input axis: every row share keeps its one column.
QUANTIZED_AXES: dict[str, dict[str, tuple[int | None, int | str, int | None, int | str]]] = {
    "w8": {"weight": (0, 1, 1, 1)},
    "gptq": {"qweight": (1, 1, 0, "word"), "qzeros": (1, "word", 0, "group"), "scales": (1, 1, 0, "group"),
             "g_idx": (None, 1, 0, 1)},
    "awq": {"qweight": (1, 8, 0, 1), "qzeros": (1, 8, 0, "group"), "scales": (1, 1, 0, "group")},
    "packed": {"weight_packed": (0, 1, 1, "word"), "weight_scale": (0, 1, 1, "group"),
               "weight_zero_point": (0, "word", 1, "group"), "weight_g_idx": (None, 1, 0, 1)},
}
ACT_ORDER = ("g_idx", "weight_g_idx")
# An asymmetric int8 W8 weight's zero points: the scale's shape, cut as the scale is.
ZERO_POINT = "weight_zero_point"


class SlicedTensors(CheckpointTensors):
    """The checkpoint's tensors as one rank sees them: each tensor ``cuts`` names reads
    (and reports its shape) as the rank's part; ``hidden`` tensors look absent (a row
    share's bias, added once after the sum over ranks). Shares the whole view's files."""

    def __init__(self, whole: CheckpointTensors, cuts: dict[str, Cut], hidden: frozenset[str] = frozenset(),
                 offsets: dict[str, int] | None = None) -> None:
        vars(self).update(vars(whole))  # the same files, names and open handles
        self.cuts, self.hidden, self.offsets = cuts, hidden, offsets or {}

    def __contains__(self, name: object) -> bool:
        return name not in self.hidden and super().__contains__(name)

    def shape(self, name: str, what: str = "") -> tuple[int, ...]:
        shape = list(super().shape(name, what))
        cut = self.cuts.get(name)
        if cut is not None:
            shape[cut.dim] = sum(end - start for start, end in cut.ranges)
        return tuple(shape)

    def get(self, name: str, what: str = "") -> torch.Tensor:
        cut = self.cuts.get(name)
        if cut is None:
            return super().get(name, what)
        parts = [self.get_part(name, (slice(None),) * cut.dim + (slice(start, end),), what)
                 for start, end in cut.ranges]
        part = parts[0] if len(parts) == 1 else torch.cat(parts, dim=cut.dim)
        return part - self.offsets[name] if name in self.offsets else part


@dataclasses.dataclass(frozen=True)
class LinearShare:
    """A quantized linear's share on this rank: output ``rows`` (a column split) or the
    input ``columns`` [start, end) (a row split), as ranges of the whole linear."""

    rows: tuple[tuple[int, int], ...] | None
    columns: tuple[int, int] | None

    def shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        if self.rows is not None:
            return sum(end - start for start, end in self.rows), in_features
        assert self.columns is not None
        return out_features, self.columns[1] - self.columns[0]


def share_cuts(tensors: CheckpointTensors, module: str, scheme: QuantScheme, shape: tuple[int, int],
               share: LinearShare) -> dict[str, Cut] | None:
    """The cut of each of linear ``module``'s stored tensors holding ``share``; None where
    a cut would not fall on the boundaries of a packed word, scale block or group (or a
    row split meets act-order columns): the linear is then read whole."""
    rows, cols = shape
    axes = dict(QUANTIZED_AXES.get(scheme.layout, {}))
    if scheme.layout == "w8":
        scale = next((name for name in scheme.scale_names if f"{module}.{name}" in tensors), None)
        if scale is None:
            return None
        numel = 1
        for size in tensors.shape(f"{module}.{scale}"):
            numel *= size
        if scheme.strategy in ("block", "group") and scheme.block is not None:  # int8 groups: blocks [1, g]
            axes[scale] = (0, scheme.block[0], 1, scheme.block[1])
        elif numel == rows and numel > 1:
            axes[scale] = (0, 1, None, 1)
        elif numel != 1:
            return None
        if not scheme.symmetric and scale in axes:  # asymmetric int8: zero points cut as their scale
            axes[ZERO_POINT] = axes[scale]
    sizes = {"word": 32 // (8 if scheme.weights == "int8" else 4), "group": scheme.group_size or cols}
    cuts: dict[str, Cut] = {}
    for leaf, (out_axis, out_unit, in_axis, in_unit) in axes.items():
        if in_unit == "group" and scheme.group_size is None:
            in_axis = None
        name = f"{module}.{leaf}"
        if name not in tensors:
            continue
        if share.columns is not None and leaf in ACT_ORDER and not in_group_order(tensors.get(name), sizes["group"]):
            return None  # act-order columns split by input: read whole (split, or refused naming it)
        if share.rows is not None:
            axis, unit, ranges, total = out_axis, out_unit, share.rows, rows
        else:
            assert share.columns is not None
            axis, unit, ranges, total = in_axis, in_unit, (share.columns,), cols
        if axis is None:
            continue
        step = sizes[unit] if isinstance(unit, str) else unit
        if any(start % step or (end % step and end != total) for start, end in ranges if end > start):
            return None
        cuts[name] = Cut(axis, tuple((start // step, -(-end // step)) for start, end in ranges))
    if share.rows is not None and f"{module}.bias" in tensors:
        cuts[f"{module}.bias"] = Cut(0, share.rows)
    return cuts


def in_group_order(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether ``g_idx`` puts the input columns in their groups in order (no act-order)."""
    return torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // group_size)


def group_offsets(cuts: dict[str, Cut], share: LinearShare, scheme: QuantScheme) -> dict[str, int]:
    """A row share's ``g_idx`` counts groups from its first column's (in group order);
    one group per row (no group size) stays group 0."""
    if share.columns is None or scheme.group_size is None:
        return {}
    first_group = share.columns[0] // scheme.group_size
    return {name: first_group for name in cuts if name.rsplit(".", 1)[-1] in ACT_ORDER}


def quantized_share_plan(model: nn.Module, group: RankGroup,
                         weights: QuantizedWeights) -> dict[str, tuple[LinearShare, dict[str, Cut]]]:
    """The quantized linears this rank reads as slices, each with its share and its
    stored tensors' cuts (the model still whole, its quantized linears on the meta
    device); the others are read whole."""
    plan = slice_plan(model, group)
    shares: dict[str, tuple[LinearShare, dict[str, Cut]]] = {}
    for name in weights.linears:
        cut, linear = plan.get(f"{name}.weight"), model.get_submodule(name)
        if cut is None or type(linear) is not nn.Linear:
            continue
        share = LinearShare(cut.ranges, None) if cut.dim == 0 else LinearShare(None, cut.ranges[0])
        cuts = share_cuts(weights.tensors, name, weights.scheme, (linear.out_features, linear.in_features), share)
        if cuts is not None:
            shares[name] = (share, cuts)
    return shares


def put_whole_linears(model: nn.Module, weights: QuantizedWeights, skip: set[str]) -> int:
    """Each quantized linear but ``skip``'s read whole, before the split (which then
    splits it with its scales, or refuses it naming it)."""
    names = [name for name in weights.linears if name not in skip]
    for name in names:
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear), f"{name} is {type(linear).__name__}, the loader left a linear"
        replace(model, name, read_quantized_linear(weights.tensors, name, weights.scheme,
                                                   (linear.out_features, linear.in_features), weights.dtype))
    return len(names)


def put_linear_shares(model: nn.Module, group: RankGroup, weights: QuantizedWeights,
                      shares: dict[str, tuple[LinearShare, dict[str, Cut]]]) -> int:
    """After the split: each planned linear's share (a meta nn.Linear, or the meta inner
    linear of a RowParallelLinear) replaced by the QuantizedLinear read from its slices;
    a row share's bias read whole and added once, after the sum over ranks."""
    for name, (share, cuts) in shares.items():
        module = model.get_submodule(name)
        inner = module.linear if isinstance(module, RowParallelLinear) else module
        assert type(inner) is nn.Linear and inner.weight.is_meta, (name, type(inner).__name__)
        hidden = frozenset({f"{name}.bias"}) if share.columns is not None else frozenset()
        sliced = SlicedTensors(weights.tensors, cuts, hidden, group_offsets(cuts, share, weights.scheme))
        part = read_quantized_linear(sliced, name, weights.scheme, (inner.out_features, inner.in_features),
                                     weights.dtype)
        setattr(part, SHARE_ATTRIBUTE, getattr(inner, SHARE_ATTRIBUTE))
        if share.columns is None:
            replace(model, name, part)
            continue
        bias_name = f"{name}.bias"
        bias = weights.tensors.get(bias_name).to(weights.dtype) if bias_name in weights.tensors else None
        replace(model, name, RowParallelQuantized(part, bias, group))
    return len(shares)


def put_expert_shares(model: nn.Module, group: RankGroup, weights: QuantizedWeights) -> int:
    """Before the split: each quantized experts module the loader left on the meta device
    (``experts_deferred``) read as this rank's share of its intermediate size
    (experts.py's ``expert_share``) by the checkpoint's own experts reader over the
    share's slices, down's bias on rank 0 only, and marked as a share (``RANK_SHARE``:
    the split sums its output over ranks without cutting it again); return how many.
    MXFP4 (gpt-oss): gate_up's interleaved rows and bias rows, down's whole 32-element
    blocks. Per-expert W8/W4: each expert's gate and up rows, down's columns, with their
    scales, in whole blocks, groups and packed words; where a slice would cut one (or
    down's act-order groups, biases or per-token input scales need the whole row) the
    module is read whole and the split cuts it, or refuses it naming it."""
    if not weights.experts_deferred:
        return 0
    model_type = str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))
    cuts: dict[str, Cut] = {}
    offsets: dict[str, int] = {}
    shares = []
    for name, module in experts_modules(model):
        if not (isinstance(module.down_proj, torch.Tensor) and module.down_proj.is_meta):
            continue  # stored unquantized: read whole at load, split as float experts
        if weights.scheme.weights == "mxfp4":
            found: tuple[dict[str, Cut], dict[str, int]] | None = (_mxfp4_cuts(module, name, group), {})
        else:
            found = _per_expert_cuts(module, name, group, weights, model_type)
        if found is not None:
            cuts.update(found[0])
            offsets.update(found[1])
            shares.append(name)
    replace_quantized_experts(model, SlicedTensors(weights.tensors, cuts, offsets=offsets), weights.scheme)
    for name in shares:
        share = model.get_submodule(name)
        assert isinstance(share, QuantizedExperts), (name, type(share).__name__)
        if group.rank:
            share.down_bias = None
        setattr(share, RANK_SHARE, True)
    return len(shares)


def _mxfp4_cuts(module: nn.Module, name: str, group: RankGroup) -> dict[str, Cut]:
    """gpt-oss's experts tensors cut to this rank's share, its size set to the share's
    (the reader's expected shapes)."""
    intermediate = module.__dict__["intermediate_size"]  # a plain int the experts module keeps
    start, end = expert_share(intermediate, MXFP4_BLOCK, group, name)
    rows, blocks = ((2 * start, 2 * end),), ((start // MXFP4_BLOCK, -(-end // MXFP4_BLOCK)),)
    module.__dict__["intermediate_size"] = end - start
    return {f"{name}.{suffix}": cut for suffix, cut in (
        ("gate_up_proj_blocks", Cut(1, rows)), ("gate_up_proj_scales", Cut(1, rows)),
        ("gate_up_proj_bias", Cut(1, rows)), ("down_proj_blocks", Cut(2, blocks)),
        ("down_proj_scales", Cut(2, blocks)))}


def _per_expert_cuts(module: nn.Module, name: str, group: RankGroup, weights: QuantizedWeights,
                     model_type: str) -> tuple[dict[str, Cut], dict[str, int]] | None:
    """Each expert's stored gate, up and down tensors cut to this rank's share (and
    down's act-order offsets), the skeleton's weights reshaped to the share's (the
    reader's expected shapes); None where the module is read whole."""
    scheme, tensors = weights.scheme, weights.tensors
    gate_up_names, down_names, renamings = per_expert_names(model_type)
    prefix = next((candidate for candidate in checkpoint_prefixes(name, renamings)
                   if len(gate_up_names) == 2 and down_names
                   and stored_quantized(tensors, f"{candidate}.0.{gate_up_names[0]}", scheme)), None)
    gate_up = module.gate_up_proj
    if prefix is None or scheme.input_quantization != "none" or not isinstance(gate_up, torch.Tensor) \
            or any(f"{prefix}.{expert}.{part}.bias" in tensors for expert in range(gate_up.shape[0])
                   for part in down_names):
        return None
    num_experts, hidden, intermediate = gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2
    first = [read_quantized_linear(tensors, f"{prefix}.0.{part}", scheme, shape, weights.dtype)  # units only
             for part, shape in ((gate_up_names[0], (intermediate, hidden)), (down_names[0], (hidden, intermediate)))]
    start, end = expert_share(intermediate, share_unit(first[:1], first[1:]), group, name)
    cuts: dict[str, Cut] = {}
    offsets: dict[str, int] = {}
    for expert in range(num_experts):
        for parts, shape, share in ((gate_up_names, (intermediate, hidden), LinearShare(((start, end),), None)),
                                    (down_names, (hidden, intermediate), LinearShare(None, (start, end)))):
            for part in parts:
                found = share_cuts(tensors, f"{prefix}.{expert}.{part}", scheme, shape, share)
                if found is None:
                    return None
                cuts.update(found)
                offsets.update(group_offsets(found, share, scheme))
    module.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * (end - start), hidden, device="meta"),
                                       requires_grad=False)
    module.down_proj = nn.Parameter(torch.empty(num_experts, hidden, end - start, device="meta"), requires_grad=False)
    return cuts, offsets
