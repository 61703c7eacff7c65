"""Fused query-key-value projections split by heads: each rank keeps the rows of its
query heads and of the key-value heads they read, in the layout its attention's
forward cuts them in, and the attention's sizes are set to its share.

Layouts (rows of the projection's output, D the head size):
- BLOCKS: [q heads | k heads | v heads] (phi3 ``qkv_proj``, GPT-2's and openai-gpt's
  Conv1D ``c_attn``, GPT-BigCode's multi-query ``c_attn``, falcon's multi-query
  layout, DBRX's ``Wqkv``): a rank keeps its query heads' rows of the first block and
  its key-value heads' rows of the other two, so its share is the same layout over
  fewer heads.
- PER_HEAD: [h0: q, k, v | h1: q, k, v | ...] (GPT-NeoX, Persimmon, BLOOM, falcon's
  original layout, GPT-NeoX-Japanese, GPT-BigCode without multi-query; CodeGen's blocks
  of [q | v | k] over consecutive heads, a rank keeping whole blocks): a rank keeps its
  heads' contiguous rows.
- GROUPED: [g0: q heads of the group, k, v | g1: ...] (falcon's new decoder
  architecture): a rank keeps its groups, or where key-value heads are fewer than
  ranks its query heads of its group and the group's key and value (replicated).

Conv1D projections (GPT-2's, weights stored [in, out]) split as the nn.Linear of the
same product. ALiBi (bloom, mpt), which the model builds for every head outside the
attention, reaches each rank's attention cut to its heads, and its adapter's slopes
too; falcon with ALiBi is refused (its adapter builds its bias table by head count).

Invariants:
- ``fused_rows`` and the loader's cut of the checkpoint tensor (engine/parallel/loading.py)
  are the same rows, and they are in the order the attention's forward cuts them.
- After the split every size the attention's forward reads (its heads, widths, its
  own config's head counts where it reads them there) is its rank's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .group import RankGroup, ShardingError
from .layers import column_share

BLOCKS, PER_HEAD, GROUPED = "blocks", "per_head", "grouped"
FUSED = "fused_qkv"
FUSED_ATTENTION = ("qkv_proj", "c_attn", "query_key_value", "Wqkv", "qkv")
# The attention's output projection beside a fused one: split by its input (its heads).
FUSED_OUTPUT = ("o_proj", "dense", "c_proj", "out_proj", "Wo")
# Dense MLPs of the decoders with a fused attention: (the projection up, the one down).
MLP_PAIRS = (("dense_h_to_4h", "dense_4h_to_h"), ("c_fc", "c_proj"), ("fc_in", "fc_out"), ("fc1", "fc2"))
# Dense MLPs whose fused gate_up_proj is [gate | up] before a down_proj, named by no plan:
# gate_up_proj split packed (each rank its gate rows and the matching up rows), and the
# last linear of each low-rank adapter added to its output (Zamba2's shared block) too;
# MiniMax-M3's shared experts.
FUSED_MLPS = ("Zamba2MLP", "MiniMaxM3VLDenseMLP")
# A packed column split of an adapter's output feeding a packed projection's sum: its
# row-split partner is the MLP's down_proj, outside its own parent module.
PACKED_ADAPTER = "packed_colwise_adapter"
# ALiBi its model builds for every head and passes to each attention by keyword (its
# name), and the slopes the attention's adapter keeps (their attribute).
ALIBI = {"BloomAttention": ("alibi", "alibi_slopes"), "MptAttention": ("position_bias", "_slopes")}
# Sizes an attention's forward reads, by its class, beyond the head counts every
# attention has set (heads.set_head_counts): the attribute and which rank size it is.
LOCAL_SIZES = {
    "GPT2Attention": {"split_size": "q_width"},
    "Attention": {"split_size": "q_width", "_split_size": "q_width", "n_head": "heads"},  # openai-gpt
    "GPTBigCodeAttention": {"kv_heads": "kv_heads", "kv_dim": "kv_width"},
    "FalconAttention": {"num_kv_heads": "kv_heads", "_num_kv_heads": "kv_heads"},
    "MptAttention": {"n_heads": "heads"},
    "DbrxAttention": {"hidden_size": "q_width"},
    "CodeGenAttention": {"mp_num": "blocks"},
}


@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """How a fused projection lays out its heads: ``kind``, query and key-value heads
    (the key-value heads the projection itself holds), and the head size."""

    kind: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    blocks: int = 1  # CodeGen's model-parallel blocks of [q | v | k] heads, whole on each rank


def fused_layout(attention: nn.Module, name: str, model_config: object) -> FusedLayout:
    """The layout of the fused projection ``name`` of ``attention`` (an adapter's
    original module is read) in a model of ``model_config``; ShardingError, one line
    naming it, where the ranks do not split it."""
    module: Any = getattr(attention, "original", attention)  # a transformers attention: its sizes are ints
    kind = type(module).__name__
    config: Any = getattr(module, "config", None) or model_config
    if kind == "FalconAttention" and config.alibi:
        raise ShardingError(f"{name}: {kind} with ALiBi, whose bias its adapter builds per head count; not split "
                            "over ranks")
    if kind == "BloomAttention":
        if module.pretraining_tp > 1 and module.slow_but_exact:
            raise ShardingError(f"{name}: BloomAttention with slow_but_exact slices its own output projection by "
                                "pretraining_tp; not split over ranks")
        return FusedLayout(PER_HEAD, module.num_heads, module.num_heads, module.head_dim)
    if kind == "Phi3Attention":
        return FusedLayout(BLOCKS, config.num_attention_heads, config.num_key_value_heads, module.head_dim)
    if kind in ("GPTNeoXAttention", "GPTNeoXJapaneseAttention"):
        heads = getattr(module, "num_attention_heads", None) or config.num_attention_heads
        return FusedLayout(PER_HEAD, heads, heads, module.head_size)
    if kind == "PersimmonAttention":
        return FusedLayout(PER_HEAD, module.num_heads, module.num_heads, module.head_dim)
    if kind == "FalconAttention":
        if module.new_decoder_architecture:
            return FusedLayout(GROUPED, module.num_heads, config.num_kv_heads, module.head_dim)
        kv = 1 if module.multi_query else module.num_heads
        return FusedLayout(BLOCKS if module.multi_query else PER_HEAD, module.num_heads, kv, module.head_dim)
    if kind == "GPT2Attention" and not module.is_cross_attention:
        return FusedLayout(BLOCKS, module.num_heads, module.num_heads, module.head_dim)
    if kind == "Attention" and hasattr(module, "n_head") and hasattr(module, "split_size"):  # openai-gpt
        return FusedLayout(BLOCKS, module.n_head, module.n_head, module.split_size // module.n_head)
    if kind == "GPTBigCodeAttention" and not module.is_cross_attention:
        return FusedLayout(BLOCKS if module.multi_query else PER_HEAD, module.num_heads, module.kv_heads,
                           module.head_dim)
    if kind == "MptAttention":
        return FusedLayout(BLOCKS, module.n_heads, module.n_heads, module.head_dim)
    if kind == "DbrxAttention":
        return FusedLayout(BLOCKS, module.num_heads, module.num_key_value_heads, module.head_dim)
    if kind == "CodeGenAttention":  # blocks of [q | v | k] over consecutive heads: a rank keeps whole blocks
        return FusedLayout(PER_HEAD, module.num_attention_heads, module.num_attention_heads, module.head_dim,
                           blocks=module.mp_num)
    raise ShardingError(f"{name}: a fused query-key-value projection of {kind}, whose layout of heads the "
                        "tensor-parallel ranks do not know; not split over ranks")


def kv_heads_of(layout: FusedLayout, rank: int, size: int) -> tuple[int, int]:
    """(first key-value head, how many) of the projection that ``rank`` of ``size`` keeps."""
    if layout.num_kv_heads >= size:
        share = layout.num_kv_heads // size
        return rank * share, share
    return rank * layout.num_kv_heads // size, 1


def fused_rows(layout: FusedLayout, name: str, rank: int, size: int) -> torch.Tensor:
    """The output rows of a fused projection laid out as ``layout`` that ``rank`` of
    ``size`` keeps, in the order its attention cuts them; ShardingError naming ``name``
    where its heads do not split."""
    heads, kv, dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
    if heads % size or (kv % size and size % kv):
        raise ShardingError(f"{name}: {heads} query and {kv} key-value heads do not split over {size} ranks")
    if layout.blocks > 1 and layout.blocks % size:
        raise ShardingError(f"{name}: its {layout.blocks} model-parallel blocks of heads do not split over {size} "
                            "ranks")
    local, (first_kv, local_kv) = heads // size, kv_heads_of(layout, rank, size)
    first = rank * local

    def span(start: int, count: int) -> torch.Tensor:  # rows of ``count`` heads from head ``start``
        return torch.arange(start * dim, (start + count) * dim)

    if layout.kind == BLOCKS:
        return torch.cat([span(first, local), span(heads + first_kv, local_kv), span(heads + kv + first_kv, local_kv)])
    if layout.kind == PER_HEAD:
        return span(3 * first, 3 * local)
    group = heads // kv + 2  # GROUPED: heads per key-value group, then its key and value
    if kv >= size:
        return span(first_kv * group, local_kv * group)
    start = first_kv * group + first - first_kv * (heads // kv)  # this rank's query heads inside its group
    return torch.cat([span(start, local), span(first_kv * group + group - 2, 2)])


def as_linear(module: nn.Module) -> nn.Module:
    """A Conv1D as the nn.Linear of the same product (its weight transposed); any
    other module as it is."""
    if not isinstance(module, Conv1D):
        return module
    in_features, out_features = module.weight.shape
    linear = nn.Linear(in_features, out_features, bias=module.bias is not None, device=module.weight.device,
                       dtype=module.weight.dtype)
    linear.weight = nn.Parameter(module.weight.detach().t(), requires_grad=False)
    if module.bias is not None:
        linear.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
    return linear


def sliced_as_linear(module: nn.Module) -> bool:
    """Whether the loader reads ``module``'s rank share as slices of a linear's weight:
    an nn.Linear, a Conv1D (its weight transposed) or falcon's FalconLinear (an
    nn.Linear computed as x @ W.T + b)."""
    return type(module) is nn.Linear or isinstance(module, Conv1D) or type(module).__name__ == "FalconLinear"


def fused_rules(model: nn.Module, skip: tuple[str, ...]) -> dict[str, str]:
    """Splits, by module name, of the attentions with a fused projection (outside
    ``skip``'s prefixes: recurrent mixers, encoders): the fused projection FUSED, its
    output projection row-wise; the ``FUSED_MLPS``' projections; and where any
    attention is fused, the dense MLPs of ``MLP_PAIRS`` column- then row-wise."""
    named: dict[str, str] = {}
    for name, module in model.named_modules():
        if f"{name}.".startswith(skip):
            continue
        children = dict(module.named_children())
        prefix = f"{name}." if name else ""
        fused = next((leaf for leaf in FUSED_ATTENTION if leaf in children), None)
        if fused is not None:
            named[prefix + fused] = FUSED
            output = next((leaf for leaf in FUSED_OUTPUT if leaf in children and leaf != fused), None)
            if output is not None:
                named[prefix + output] = "rowwise"
    for name, module in model.named_modules():
        if type(module).__name__ in FUSED_MLPS and not f"{name}.".startswith(skip):
            named.update({f"{name}.gate_up_proj": "packed_colwise", f"{name}.down_proj": "rowwise"})
            adapters = getattr(module, "gate_up_proj_adapter_list", None) or []
            named.update({f"{name}.gate_up_proj_adapter_list.{index}.{len(adapter) - 1}": PACKED_ADAPTER
                          for index, adapter in enumerate(adapters) if isinstance(adapter, nn.Sequential)})
    if not any(split == FUSED for split in named.values()):
        return named
    for name, module in model.named_modules():
        children = dict(module.named_children())
        prefix = f"{name}." if name else ""
        for up, down in MLP_PAIRS:
            if up in children and down in children and f"{prefix}{down}" not in named:
                named.update({prefix + up: "colwise", prefix + down: "rowwise"})
    return named


def fused_share(module: nn.Module, name: str, layout: FusedLayout, group: RankGroup) -> nn.Module:
    """This rank's share of the fused projection ``module`` (an nn.Linear, a Conv1D or
    a quantized linear) laid out as ``layout``; its LoRA share keeps the same rows."""
    return column_share(as_linear(module), name, fused_rows(layout, name, group.rank, group.size), group)


def set_fused_sizes(attention: nn.Module, layout: FusedLayout, group: RankGroup) -> None:
    """Set the sizes ``attention``'s forward reads for its fused projection (laid out
    as ``layout``, the whole model's) to this rank's (``LOCAL_SIZES``; phi3 reads its
    query width from its config: the attention gets a view of it with this rank's
    head counts)."""
    module = getattr(attention, "original", attention)
    _, local_kv = kv_heads_of(layout, group.rank, group.size)
    local = layout.num_heads // group.size
    sizes = {"heads": local, "kv_heads": local_kv, "q_width": local * layout.head_dim,
             "kv_width": local_kv * layout.head_dim, "blocks": max(1, layout.blocks // group.size)}
    for target in dict.fromkeys((attention, module)):
        for attribute, size in LOCAL_SIZES.get(type(module).__name__, {}).items():
            if isinstance(getattr(target, attribute, None), int):
                setattr(target, attribute, sizes[size])
        if type(module).__name__ in ALIBI and target is attention:
            keep_alibi_heads(attention, ALIBI[type(module).__name__], layout.num_heads, group.rank * local, local)
        if type(module).__name__ == "Phi3Attention":
            view = RankHeadsConfig(getattr(module.config, "whole", module.config),
                                   {"num_attention_heads": local, "num_key_value_heads": local_kv})
            setattr(target, "config", view)  # noqa: B010 - a plain attribute of an nn.Module


def keep_alibi_heads(attention: nn.Module, names: tuple[str, str], num_heads: int, start: int, count: int) -> None:
    """Keep heads ``start`` .. ``start + count`` of ``attention``'s ALiBi: its adapter's
    slopes, and the bias its model builds for all ``num_heads`` and passes to it
    (names: the forward's keyword, the adapter's slopes attribute)."""
    argument, slopes_name = names
    slopes = getattr(attention, slopes_name, None)
    if isinstance(slopes, torch.Tensor) and slopes.shape[0] == num_heads:
        setattr(attention, slopes_name, slopes[start: start + count].clone())

    def rank_heads(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        bias = kwargs.get(argument)
        if not isinstance(bias, torch.Tensor):
            return None
        # bias: [B * H, 1, L] (bloom) or [H, 1, L] (mpt) -> this rank's heads'
        rows = bias.view(-1, num_heads, *bias.shape[1:])[:, start: start + count]
        return args, {**kwargs, argument: rows.reshape(-1, *bias.shape[1:])}

    attention.register_forward_pre_hook(rank_heads, with_kwargs=True)


class RankHeadsConfig:
    """A model config as an attention of one rank reads it: its head counts the rank's,
    every other attribute the model's own, read and written through (the load check
    switches the model's attention implementation on the model's config)."""

    def __init__(self, whole: object, local: dict[str, int]) -> None:
        object.__setattr__(self, "whole", whole)
        object.__setattr__(self, "local", local)

    def __getattr__(self, name: str) -> object:
        local = object.__getattribute__(self, "local")
        return local[name] if name in local else getattr(object.__getattribute__(self, "whole"), name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self.whole, name, value)
