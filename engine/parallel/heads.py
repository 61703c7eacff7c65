"""A model's attention heads and each rank's share of them: the query and key-value
head counts (per layer where layers have their own), the key-value heads a rank holds
(the one its query heads read where they are fewer than ranks), and the head counts an
attention module reads, set to its rank's after the split (engine/parallel/sharding.py).
"""

from __future__ import annotations

import dataclasses
import re

import transformers
from torch import nn

from .attention_norms import span_head_norms
from .group import RankGroup


@dataclasses.dataclass(frozen=True)
class Heads:
    """A model's attention heads: query and key-value."""

    num_heads: int
    num_kv_heads: int

    def kv_head_of(self, rank: int, size: int) -> tuple[int, int]:
        """(first key-value head, how many) that ``rank`` of ``size`` holds."""
        if self.num_kv_heads >= size:
            share = self.num_kv_heads // size
            return rank * share, share
        return rank * self.num_kv_heads // size, 1


def model_heads(hf_config: transformers.PretrainedConfig) -> Heads | None:
    """The text model's heads (None for a model without attention heads); for a model
    whose layers have heads of their own counts (dots3_note's per-layer config), its
    first layer's (``layer_heads`` gives each layer's)."""
    text_config = hf_config.get_text_config()
    per_layer = layer_heads(hf_config)
    if per_layer:
        return per_layer[0]
    text_config = (getattr(text_config, "per_layer_config", None) or [text_config])[0]
    num_heads = getattr(text_config, "num_attention_heads", None)
    if not num_heads:
        return None
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    return Heads(int(num_heads), int(num_kv_heads))


def layer_heads(hf_config: transformers.PretrainedConfig) -> tuple[Heads, ...]:
    """Each layer's heads where the layers have counts of their own (a per-layer config
    whose counts differ: dots3_note's sliding and indexed layers); else empty."""
    per_layer = getattr(hf_config.get_text_config(), "per_layer_config", None) or []
    heads = tuple(Heads(int(layer.num_attention_heads), int(getattr(layer, "num_key_value_heads", None)
                                                            or layer.num_attention_heads))
                  for layer in per_layer if getattr(layer, "num_attention_heads", None))
    return heads if len(set(heads)) > 1 and len(heads) == len(per_layer) else ()


def heads_at(name: str, heads: Heads | None, per_layer: tuple[Heads, ...]) -> Heads | None:
    """The heads of the layer module ``name`` belongs to (``layers.<i>.``): its own where
    the layers' counts differ, else the model's."""
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", f"{name}.")
    if per_layer and match and int(match[1]) < len(per_layer):
        return per_layer[int(match[1])]
    return heads


def set_local_heads(attention: nn.Module, heads: Heads | None, group: RankGroup) -> None:
    """Set an attention module's head counts to this rank's (the eager reference and
    any adapter read them; the paged attention reads the tensors' shapes)."""
    if heads is None:
        return
    num_heads = heads.num_heads // group.size
    _, num_kv_heads = heads.kv_head_of(group.rank, group.size)
    original = getattr(attention, "original", None)  # an adapter's module, whose own forward is the reference
    for module in (attention, original) if isinstance(original, nn.Module) else (attention,):
        set_head_counts(module, heads, num_heads, num_kv_heads)
    sinks = getattr(attention, "sinks", None)  # one logit per query head (gpt-oss): this rank's heads'
    if isinstance(sinks, nn.Parameter) and sinks.dim() == 1 and sinks.shape[0] == heads.num_heads:
        start = group.rank * num_heads
        share = nn.Parameter(sinks.detach()[start: start + num_heads].contiguous(), requires_grad=False)
        for module in (attention, original) if isinstance(original, nn.Module) else (attention,):
            module.sinks = share  # an adapter's original (its forward: the load check's reference) too


def span_norms(attention: nn.Module, name: str, heads: Heads | None, group: RankGroup) -> int:
    """Replace the attention's q/k norms over all its heads by spanning ones over this
    rank's (attention_norms.py); return how many were replaced."""
    if heads is None:
        return 0
    first_kv, num_kv = heads.kv_head_of(group.rank, group.size)
    num_heads = heads.num_heads // group.size
    return span_head_norms(attention, name, {"q_norm": (heads.num_heads, group.rank * num_heads, num_heads),
                                             "k_norm": (heads.num_kv_heads, first_kv, num_kv)}, group)


def set_head_counts(attention: nn.Module, heads: Heads, num_heads: int, num_kv_heads: int) -> None:
    """Set the integer head counts an attention module (or its adapter) reads to this
    rank's, and its ``embed_dim`` where that is the heads' width (xglm reshapes to it)."""
    for attribute, value in (("num_heads", num_heads), ("num_attention_heads", num_heads),
                             ("num_key_value_heads", num_kv_heads),
                             ("num_key_value_groups", num_heads // num_kv_heads)):
        if isinstance(getattr(attention, attribute, None), int):
            setattr(attention, attribute, value)
    head_dim, embed_dim = getattr(attention, "head_dim", None), getattr(attention, "embed_dim", None)
    if isinstance(head_dim, int) and embed_dim == heads.num_heads * head_dim:
        setattr(attention, "embed_dim", num_heads * head_dim)  # noqa: B010 - an int attribute of an nn.Module
