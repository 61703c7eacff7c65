"""Recurrent mixers split by channels over tensor-parallel ranks, beside the gated
delta-net and Mamba kinds of engine/parallel/recurrent.py.

- LFM2's short convolution (lfm2, lfm2_moe, lfm3): every channel is its own causal
  convolution of B*x, gated by C, so a rank keeps its share of the channels: in_proj's
  rows of them in each of B, C and x, the convolution's, and out_proj's columns
  (row-parallel). Its state (the last inputs of its channels) shrinks with them.
- RWKV-4's block: the WKV recurrence keeps a numerator, denominator and maximum per
  channel of the time mix, so a rank keeps its share of those channels: key, value and
  receptance rows, time_decay and time_first, and output's columns (row-parallel).
  The channel mix is an MLP: key's rows and value's columns (row-parallel); its
  receptance, which gates the summed output, and both token shifts (over the hidden
  size) stay whole.

Invariants: as engine/parallel/recurrent.py's (a mixer split whole or not at all; its
output summed over ranks by its row-parallel projections).
"""

from __future__ import annotations

from torch import nn

from .group import RankGroup
from .layers import column_share, row_share
from .mixers_base import Parts, RunWhole, depthwise_conv, module_of, ranges, share, sliced, tensor_of

SHORT_CONV = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")
RWKV = ("RwkvBlock",)


def short_conv_share(module: nn.Module, name: str, group: RankGroup) -> tuple[Parts, dict[str, int]]:
    """The rank's parts of an LFM2 short convolution (module docstring); no size
    attribute changes (its kind reads the convolution's width)."""
    conv = module_of(module, "conv")
    width = tensor_of(conv, "weight").shape[0]
    first, count = share(width, group, "channels")
    projection = module_of(module, "in_proj")
    if getattr(projection, "out_features", None) != 3 * width:
        raise RunWhole("its input projection has rows beside B, C and x")
    rows = ranges((first, count), (width + first, count), (2 * width + first, count))
    parts: Parts = {"in_proj": column_share(projection, f"{name}.in_proj", rows, group),
                    "conv": depthwise_conv(conv, ranges((first, count))),
                    "out_proj": row_share(module_of(module, "out_proj"), f"{name}.out_proj", group)}
    return parts, {}


def rwkv_share(module: nn.Module, name: str, group: RankGroup) -> tuple[Parts, dict[str, int]]:
    """The rank's parts of an RWKV block (module docstring): replaced inside its time
    mix (``attention``) and channel mix (``feed_forward``) modules, so the returned parts
    are named by their path under the block."""
    attention, feed_forward = module_of(module, "attention"), module_of(module, "feed_forward")
    width = tensor_of(attention, "time_decay").shape[0]
    first, count = share(width, group, "time-mix channels")
    channels = ranges((first, count))
    parts: Parts = {}
    for attribute in ("key", "value", "receptance"):
        parts[f"attention.{attribute}"] = column_share(module_of(attention, attribute), f"{name}.attention.{attribute}",
                                                       channels, group)
    for attribute in ("time_decay", "time_first"):
        parts[f"attention.{attribute}"] = sliced(tensor_of(attention, attribute), channels)
    parts["attention.output"] = row_share(module_of(attention, "output"), f"{name}.attention.output", group)
    key = module_of(feed_forward, "key")
    inner = getattr(key, "out_features", None)
    if not isinstance(inner, int):
        raise RunWhole("its channel mix's key is not a linear")
    first, count = share(inner, group, "channel-mix channels")
    parts["feed_forward.key"] = column_share(key, f"{name}.feed_forward.key", ranges((first, count)), group)
    parts["feed_forward.value"] = row_share(module_of(feed_forward, "value"), f"{name}.feed_forward.value", group)
    return parts, {}
