"""DeepSeek-V4's grouped output projection over tensor-parallel ranks.

Its attention's output (heads x head_dim) is cut into ``o_groups`` groups of consecutive
heads; ``o_a_proj`` (a block-diagonal grouped linear) projects each group on its own to
``o_lora_rank`` numbers, and ``o_b_proj`` mixes the groups' outputs into the hidden
size. A rank holding its share of the heads holds whole groups (the groups split
evenly over the ranks), so it keeps those groups' blocks of ``o_a_proj`` and its
columns of ``o_b_proj`` (row-parallel: the mix summed over ranks). The attention's
group count, which the adapter and the original's forward read (the original from its
config), becomes the rank's.

Invariant: a group never spans two ranks; a count that does not split is refused,
naming the projection.
"""

from __future__ import annotations

import copy

import transformers
from torch import nn

from .group import RankGroup, ShardingError

GROUPED = "grouped"
# An attention whose output goes through a grouped projection and a mix (DeepSeek-V4).
GROUPED_OUTPUT = ("q_b_proj", "o_a_proj", "o_b_proj")


def split_grouped_linear(module: nn.Module, name: str, group: RankGroup) -> nn.Module:
    """``module`` (a grouped linear: ``n_groups`` blocks of output rows) keeping this
    rank's groups' rows; ShardingError, naming ``name``, where it is no grouped
    nn.Linear or its groups do not split."""
    num_groups = getattr(module, "n_groups", None)
    if type(module) is nn.Linear or not isinstance(module, nn.Linear) or not isinstance(num_groups, int):
        raise ShardingError(f"{name}: a {type(module).__name__} is not the grouped linear the ranks split "
                            "(an nn.Linear with n_groups blocks of output rows)")
    if num_groups % group.size or module.out_features % num_groups:
        raise ShardingError(f"{name}: its {num_groups} output groups do not split over {group.size} ranks")
    count, rows = num_groups // group.size, module.out_features // num_groups
    start, stop = group.rank * count * rows, (group.rank + 1) * count * rows
    module.weight = nn.Parameter(module.weight.detach()[start:stop].contiguous(), requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.detach()[start:stop].contiguous(), requires_grad=False)
    module.out_features = count * rows
    setattr(module, "n_groups", count)  # noqa: B010 - an int attribute of an nn.Module
    return module


def set_local_groups(attention: nn.Module) -> None:
    """Give ``attention`` (an adapter, and its original) the group count of its split
    ``o_a_proj``: the adapter's ``o_groups`` and a copy of the original's config."""
    num_groups = getattr(getattr(attention, "o_a_proj", None), "n_groups", None)
    if not isinstance(num_groups, int):
        return
    if isinstance(getattr(attention, "o_groups", None), int):
        setattr(attention, "o_groups", num_groups)  # noqa: B010 - an int attribute of an nn.Module
    original = getattr(attention, "original", None)
    for module in (attention, original) if isinstance(original, nn.Module) else (attention,):
        config = module.__dict__.get("config")
        if isinstance(config, transformers.PretrainedConfig) and getattr(config, "o_groups", None) != num_groups:
            local = copy.copy(config)
            setattr(local, "o_groups", num_groups)  # noqa: B010 - a config field
            module.__dict__["config"] = local
