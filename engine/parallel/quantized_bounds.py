"""Whether a quantized checkpoint's linears split over the ranks on their scales' bounds.

A linear stored with one scale per block or group splits exactly only where every
rank's share holds whole blocks or groups: the output rows of a column split fall on
the row bounds of FP8 blocks; the input columns of a row split on the column bounds of
FP8 blocks, int8 groups (compressed-tensors int-quantized and pack-quantized W8A16,
8-bit GPTQ) and int4 groups (W4A16, GPTQ, AWQ), and int4 codes, two to a byte, on an
even column (one group over the whole row splits anywhere else). A share may end
at the weight's end inside a partial last block. Anything else would need a scale for
part of a block, which no rank has: such a linear is refused, in one line naming the
linear, the checkpoint's format and the share that cuts a block.

The same line comes from the pre-flight verdict (engine/parallel/verdict.py), for the
linears the checkpoint's config quantizes, and from the load (placement.py), for the
linears it stores quantized, before any of them is read. What only the tensors show (an
act-order ``g_idx`` mixing the ranks' columns) is refused by the split itself
(quantized.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from ..quantization.methods import quantization_config_of
from ..quantization.scheme import QuantScheme
from .group import RankGroup, ShardingError
from .loading import slice_plan


def share_units(scheme: QuantScheme, in_features: int) -> tuple[int, int, str]:
    """The output rows and input columns a share must hold whole in ``scheme``'s
    layout (1: none), and what the unit is called in a refusal."""
    if scheme.layout == "float" or scheme.online:  # per-channel scales, or float linears
        return 1, 1, ""
    if scheme.weights == "int4":
        group = scheme.group_size
        if group is None or group >= in_features:  # one group per row: only the bytes of two codes
            return 1, 2, "bytes of 4-bit codes (two to a byte)"
        return 1, group, "scale groups"
    if scheme.block is not None:
        rows, columns = scheme.block
    elif scheme.layout == "gptq" and scheme.weights == "int8":  # blocks of one row by a group (or the whole row)
        rows, columns = 1, scheme.group_size or in_features
    else:
        return 1, 1, ""
    if rows == 1 and columns >= in_features:  # one group per row: a row share keeps it (quantized.py)
        columns = 1
    return rows, columns, "scale blocks" if scheme.strategy == "block" else "scale groups"


def cut_refusal(name: str, scheme: QuantScheme, dim: int, ranges: Iterable[tuple[int, int]],
                shape: tuple[int, int], size: int) -> str | None:
    """Why the share ``ranges`` of linear ``name`` ([out, in] ``shape``) along ``dim``
    (0: output rows, a column split; 1: input columns, a row split) cannot be cut from
    its blocks or groups over ``size`` ranks; None where it can."""
    out_features, in_features = shape
    row_unit, column_unit, unit_name = share_units(scheme, in_features)
    unit, total, what = (row_unit, out_features, "output rows") if dim == 0 else \
        (column_unit, in_features, "input columns")
    for start, end in ranges:
        if end > start and (start % unit or (end % unit and end != total)):
            return (f"{name}: a rank's share [{start}, {end}) of its {total} {what} does not fall on the bounds of "
                    f"its {unit_name} of {unit} ({scheme.description} checkpoint; a share must hold whole ones); it "
                    f"is not split over {size} ranks")
    return None


def refuse_cut_blocks(model: nn.Module, group: RankGroup, scheme: QuantScheme, names: Iterable[str]) -> None:
    """ShardingError, the first refusal's line, where ``group``'s rank's share of one of
    the quantized linears ``names`` (of the whole model, shapes only) would cut a block
    or group."""
    plan = slice_plan(model, group)
    for name in names:
        cut, linear = plan.get(f"{name}.weight"), model.get_submodule(name)
        if cut is None or not isinstance(linear, nn.Linear) or cut.transposed:
            continue
        refusal = cut_refusal(name, scheme, cut.dim, cut.ranges, (linear.out_features, linear.in_features),
                              group.size)
        if refusal is not None:
            raise ShardingError(refusal)


def configured_linears(model: nn.Module, hf_config: Any, scheme: QuantScheme) -> list[str]:
    """The linears of ``model`` (built from ``hf_config``) its quantization_config says
    the checkpoint stores quantized: every linear but the output embeddings and the
    ignored ones. None of them where compressed-tensors config groups target fewer than
    every linear: only the checkpoint's tensors say which (the load decides)."""
    if scheme.layout == "float" or scheme.online:
        return []
    config = quantization_config_of(hf_config) or {}
    groups = config.get("config_groups") or {}
    if scheme.method == "compressed-tensors" and any(
            list((group or {}).get("targets") or []) != ["Linear"] for group in groups.values()):
        return []
    output = getattr(model, "get_output_embeddings", lambda: None)()
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and module is not output and not scheme.ignores(name)]
