"""Recurrent mixers split over tensor-parallel ranks: each rank runs its share of a
layer's heads, with their convolution channels and per-head parameters, and its state
slots hold those heads only.

- Gated delta-net (Qwen3-Next, Qwen3.5 and their MoE and text variants, LaraMini,
  Qwen4-exp, OLMo hybrid with its separate q/k/v/g/a/b projections and o_proj): the
  key and value heads split evenly (rank r: key heads r*Hk/n.., value heads r*Hv/n..,
  the value heads its key heads serve); the input projections keep those heads' rows
  (Qwen3-Next's fused q|k|v|z and b|a rows are grouped by key head, so a rank's rows
  are one contiguous share), the convolution its q, k and v channels, A_log and
  dt_bias their heads; the per-head gated norm stays whole; out_proj is row-parallel.
- Mamba-1 (mamba, falcon_mamba, jamba): channels split evenly (in_proj's x and gate
  rows, the convolution, dt_proj's rows, A_log and D); x_proj, which reads every
  channel, is row-parallel, so dt, B and C are whole on every rank; out_proj row-parallel.
- Mamba-2 (mamba2, bamba, nemotron_h, granitemoehybrid, zamba2, falcon_h1): heads
  split evenly with their x and gate channels, groups too where they split evenly;
  with fewer groups than ranks (ranks a multiple of them) each rank keeps the B and C
  channels of the one group its heads read, and the gated norm, whose groups then span
  ranks, sums each group's squares over ranks (layers.SpanningGatedNorm); out_proj is
  row-parallel.
- LFM2's short convolution and RWKV's block (by channels), Kimi delta attention,
  MiniMax's lightning attention, RecurrentGemma's RG-LRU, xLSTM's mLSTM layer and
  Zamba's Mamba mixer (by heads): engine/parallel/mixers.py.

Other recurrent kinds, and a mixer whose counts do not split, run whole on every rank
with their whole state (their projections' outputs are the unsplit module's); the load
log names each and why.

Invariants:
- A split mixer's size attributes (head and group counts, widths) are this rank's, so
  its kind's state shapes (engine/recurrent/) and the module's own forward (the load
  check's reference) both read the rank's share; its output is summed over ranks by
  out_proj, so every rank holds the whole layer's output.
- A mixer is split whole or not at all: every share is built before any is installed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..recurrent import kinds  # noqa: F401 - its import registers every kind the engine runs
from ..recurrent.base import projection_out_features, registered_module_classes
from ..surgery import replace
from .group import RankGroup, ShardingError
from .layers import SpanningGatedNorm, column_share, row_share
from .mixers import (
    KDA,
    LIGHTNING,
    MLSTM,
    RG_LRU,
    RWKV,
    SHORT_CONV,
    ZAMBA_MAMBA,
    kda_share,
    lightning_share,
    mlstm_share,
    rg_lru_share,
    rwkv_share,
    short_conv_share,
    zamba_mamba_share,
)
from .mixers_base import Parts, RunWhole, depthwise_conv, int_of, module_of, ranges, share, sliced, tensor_of

logger = logging.getLogger(__name__)

GATED_DELTA_NET = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                   "LaraMiniGatedDeltaNet", "Qwen4ExpTextGatedDeltaNet", "OlmoHybridGatedDeltaNet")
MAMBA = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer")
MAMBA2 = ("Mamba2Mixer", "NemotronHMamba2Mixer", "BambaMixer", "Zamba2MambaMixer", "FalconH1Mixer",
          "GraniteMoeHybridMambaLayer")
# Every other recurrent mixer class the engine runs; each runs whole on every rank.
WHOLE_REASON = "its kind is not split over ranks"


Share = Callable[[nn.Module, str, RankGroup], tuple[Parts, Mapping[str, object]]]


def recurrent_mixer_names(model: nn.Module) -> tuple[str, ...]:
    """Every recurrent mixer's name with a trailing dot (split here or run whole): no
    name rule of the sharding step applies inside one."""
    classes = set(registered_module_classes()) | set(SPLITS)
    return tuple(f"{name}." for name, module in model.named_modules() if type(module).__name__ in classes)


def shard_recurrent_mixers(model: nn.Module, group: RankGroup) -> list[str]:
    """Replace each splittable mixer's parts by this rank's share (this module's and
    engine/parallel/mixers.py's docstrings); return the names of the mixers split. The
    other recurrent mixers the engine runs (engine/recurrent/) are logged as running
    whole, with the reason."""
    recurrent_classes = registered_module_classes()
    split, whole = [], {}
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if kind not in recurrent_classes and kind not in SPLITS:
            continue
        try:
            if kind not in SPLITS:
                raise RunWhole(WHOLE_REASON)
            parts, sizes = SPLITS[kind](module, name, group)
        except (RunWhole, ShardingError) as reason:
            whole.setdefault(kind, str(reason))
            continue
        install(module, parts, sizes)
        split.append(name)
    for kind, reason in whole.items():
        logger.info("tensor parallelism: %s layers run whole on each of %d ranks (%s)", kind, group.size, reason)
    return split


def install(module: nn.Module, parts: Parts, sizes: Mapping[str, object]) -> None:
    """Put a mixer's ``parts`` and ``sizes`` (by their dotted paths under it) in place."""
    for path, part in parts.items():
        if isinstance(part, nn.Module):
            replace(module, path, part)
        else:
            owner, _, attribute = path.rpartition(".")
            setattr(module.get_submodule(owner), attribute, part)
    for path, value in sizes.items():
        owner, _, attribute = path.rpartition(".")
        setattr(module.get_submodule(owner), attribute, value)


def gated_delta_net_share(module: nn.Module, name: str, group: RankGroup) -> tuple[Parts, dict[str, int]]:
    """The rank's parts of a gated delta-net and its sizes (module docstring)."""
    num_k_heads, num_v_heads = int_of(module, "num_k_heads"), int_of(module, "num_v_heads")
    head_k_dim, head_v_dim = int_of(module, "head_k_dim"), int_of(module, "head_v_dim")
    first_k, k_heads = share(num_k_heads, group, "key heads")
    first_v, v_heads = share(num_v_heads, group, "value heads")
    key_dim, k_width = num_k_heads * head_k_dim, k_heads * head_k_dim
    channels = ranges((first_k * head_k_dim, k_width), (key_dim + first_k * head_k_dim, k_width),
                      (2 * key_dim + first_v * head_v_dim, v_heads * head_v_dim))
    value_rows, head_rows = ranges((first_v * head_v_dim, v_heads * head_v_dim)), ranges((first_v, v_heads))
    output = "o_proj" if hasattr(module, "g_proj") else "out_proj"  # OLMo hybrid's names
    parts: Parts = {"conv1d": depthwise_conv(module_of(module, "conv1d"), channels),
                    output: row_share(module_of(module, output), f"{name}.{output}", group)}
    key_rows = ranges((first_k * head_k_dim, k_width))
    if hasattr(module, "g_proj"):  # OLMo hybrid: q, k, v, gate, a and b projections of their own
        for attribute, rows in (("q_proj", key_rows), ("k_proj", key_rows), ("v_proj", value_rows),
                                ("g_proj", value_rows), ("b_proj", head_rows), ("a_proj", head_rows)):
            parts[attribute] = column_share(module_of(module, attribute), f"{name}.{attribute}", rows, group)
    elif hasattr(module, "in_proj_qkvz"):  # rows grouped by key head: one contiguous share each
        for attribute in ("in_proj_qkvz", "in_proj_ba"):
            projection = module_of(module, attribute)
            _, rows = share(projection_out_features(projection), group, f"{attribute} rows")
            parts[attribute] = column_share(projection, f"{name}.{attribute}",
                                            ranges((group.rank * rows, rows)), group)
    else:
        for attribute, rows in (("in_proj_qkv", channels), ("in_proj_z", value_rows), ("in_proj_b", head_rows),
                                ("in_proj_a", head_rows)):
            parts[attribute] = column_share(module_of(module, attribute), f"{name}.{attribute}", rows, group)
    for attribute in ("A_log", "dt_bias"):
        parts[attribute] = sliced(tensor_of(module, attribute), head_rows)
    sizes = dict(num_k_heads=k_heads, num_v_heads=v_heads, key_dim=k_heads * head_k_dim,
                 value_dim=v_heads * head_v_dim, conv_dim=2 * k_heads * head_k_dim + v_heads * head_v_dim)
    return parts, sizes


def mamba_share(module: nn.Module, name: str, group: RankGroup) -> tuple[Parts, dict[str, int]]:
    """The rank's parts of a Mamba-1 mixer and its sizes: its share of the channels (the
    x and gate rows of in_proj, the convolution, dt_proj's rows, A_log and D), x_proj
    row-parallel (dt, B and C, which read every channel, summed over ranks before
    dt_proj and any norm of them), out_proj row-parallel."""
    inner = int_of(module, "intermediate_size")
    first, count = share(inner, group, "channels")
    channels = ranges((first, count))
    projection = module_of(module, "in_proj")
    if projection_out_features(projection) != 2 * inner:
        raise RunWhole("its input projection has rows beside x and the gate")
    rows = ranges((first, count), (inner + first, count))  # x, then the gate
    parts: Parts = {"in_proj": column_share(projection, f"{name}.in_proj", rows, group),
                    "conv1d": depthwise_conv(module_of(module, "conv1d"), channels),
                    "x_proj": row_share(module_of(module, "x_proj"), f"{name}.x_proj", group),
                    "dt_proj": column_share(module_of(module, "dt_proj"), f"{name}.dt_proj", channels, group),
                    "out_proj": row_share(module_of(module, "out_proj"), f"{name}.out_proj", group)}
    for attribute in ("A_log", "D"):
        parts[attribute] = sliced(tensor_of(module, attribute), channels)
    return parts, {"intermediate_size": count}


def mamba2_share(module: nn.Module, name: str, group: RankGroup) -> tuple[Parts, dict[str, int]]:
    """The rank's parts of a Mamba-2 mixer and its sizes (module docstring)."""
    num_heads, head_dim = int_of(module, "num_heads"), int_of(module, "head_dim")
    num_groups, state_size = int_of(module, "n_groups"), int_of(module, "ssm_state_size")
    inner = int_of(module, "intermediate_size")
    first_head, heads = share(num_heads, group, "heads")
    if num_groups % group.size == 0:
        first_group, groups = share(num_groups, group, "groups")
    elif group.size % num_groups == 0:  # each rank's heads read one group, kept on every rank that reads it
        first_group, groups = group.rank * num_groups // group.size, 1
    else:
        raise RunWhole(f"its {num_groups} groups split over {group.size} ranks only when one count divides the other")
    projection = module_of(module, "in_proj")
    if projection_out_features(projection) != 2 * inner + 2 * num_groups * state_size + num_heads:
        raise RunWhole("its input projection has rows beside gate, x, B, C and dt")
    width = num_groups * state_size
    x = (first_head * head_dim, heads * head_dim)
    b = (inner + first_group * state_size, groups * state_size)
    c = (inner + width + first_group * state_size, groups * state_size)
    channels = ranges(x, b, c)
    rows = torch.cat([ranges(x), channels + inner, ranges((2 * inner + 2 * width + first_head, heads))])
    head_rows = ranges((first_head, heads))
    parts: Parts = {"in_proj": column_share(projection, f"{name}.in_proj", rows, group),
                    "conv1d": depthwise_conv(module_of(module, "conv1d"), channels),
                    "out_proj": row_share(module_of(module, "out_proj"), f"{name}.out_proj", group)}
    for attribute in ("A_log", "dt_bias", "D"):
        parts[attribute] = sliced(tensor_of(module, attribute), head_rows)
    norm = getattr(module, "norm", None)
    if isinstance(norm, nn.Module) and getattr(module, "mamba_rms_norm", True):  # falcon_h1 may have none
        parts["norm"] = gated_norm_share(norm, name, ranges(x), num_groups, first_group, group)
    sizes = dict(num_heads=heads, n_groups=groups, intermediate_size=heads * head_dim,
                 conv_dim=heads * head_dim + 2 * groups * state_size)
    mup_vector = getattr(module, "mup_vector", None)  # falcon_h1: a buffer over the projection's rows
    if isinstance(mup_vector, torch.Tensor):
        module.register_buffer("mup_vector", mup_vector[..., rows.to(mup_vector.device)].contiguous(),
                               persistent=False)
    if hasattr(module, "groups_time_state_size"):  # falcon_h1
        sizes["groups_time_state_size"] = groups * state_size
    return parts, sizes


def gated_norm_share(norm: nn.Module, name: str, channels: torch.Tensor, num_groups: int, first_group: int,
                     group: RankGroup) -> nn.Module:
    """The mixer's gated norm over this rank's ``channels``: the norm itself with its
    weight's share where its groups lie within ranks, a SpanningGatedNorm where they span
    several (transformers' grouped form only; falcon_h1's norm, with its gate after the
    norm, runs whole then)."""
    weight = tensor_of(norm, "weight")
    spans = num_groups < group.size
    group_size = getattr(norm, "group_size", None)
    if isinstance(group_size, int):  # weight * norm(x * silu(gate)) per group of group_size channels
        if not spans:
            norm.weight = sliced(weight, channels)
            return norm
        return SpanningGatedNorm(weight.detach()[channels.to(weight.device)], group_size,
                                 float(getattr(norm, "variance_epsilon", 1e-6)), num_groups, first_group, group)
    if isinstance(getattr(norm, "n_groups", None), int) and not spans:  # falcon_h1: groups by count
        norm.weight = sliced(weight, channels)
        setattr(norm, "n_groups", num_groups // group.size)  # noqa: B010 - an int attribute of an nn.Module
        return norm
    raise RunWhole(f"its norm {type(norm).__name__} spans ranks' channels")


SPLITS: dict[str, Share] = {**dict.fromkeys(GATED_DELTA_NET, gated_delta_net_share),
                            **dict.fromkeys(MAMBA, mamba_share), **dict.fromkeys(MAMBA2, mamba2_share),
                            **dict.fromkeys(SHORT_CONV, short_conv_share), **dict.fromkeys(RWKV, rwkv_share),
                            **dict.fromkeys(KDA, kda_share), **dict.fromkeys(LIGHTNING, lightning_share),
                            **dict.fromkeys(RG_LRU, rg_lru_share), **dict.fromkeys(MLSTM, mlstm_share),
                            **dict.fromkeys(ZAMBA_MAMBA, zamba_mamba_share)}
