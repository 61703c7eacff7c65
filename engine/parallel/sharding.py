"""Which module of a model each rank splits, and how: the surgery step ``shard_model``
and the per-rank cache spec (the refusals made before any rank starts: verdict.py).

The split follows the model's tensor-parallel plan where transformers gives one
(``base_model_tp_plan``: "colwise", "rowwise", "packed_colwise", "moe_tp_experts",
"embedding_rowwise", "rowwise_split_input" resolved by what feeds it, and the styles
that keep a module whole; the experts modules its ``base_model_ep_plan`` dispatches to
as "moe_tp_experts"), and shape rules where
it names nothing: q/k/v (and MLA's q_b_proj, kv_b_proj) and gate/up column-wise, o/down
row-wise, and an attention's out_proj or Wo row-wise where q/k/v_proj sit beside it; a
fused query-key-value projection by heads in its attention's layout (fused.py).
The input embedding is split along the vocabulary and the LM head along its output,
the logits gathered. Experts are tensor-parallel: every rank routes every token
and computes each expert over its share of the intermediate size, the experts' output
summed over ranks (no token moves between ranks). Recurrent mixers are left to their own
rules: gated delta-net, Mamba, LFM2's short convolution, RWKV, Kimi delta attention,
MiniMax's lightning attention and RecurrentGemma's RG-LRU split their heads or
channels and state (engine/parallel/recurrent.py, mixers.py); the other recurrent
mixers run whole on every rank with their whole state, no name rule splitting a part
of one.

Invariants:
- Every attention layer's query heads split evenly over the ranks; key-value heads
  split evenly, or (fewer of them than ranks, the ranks a multiple of them) each rank
  holds the one its query heads read. The cache spec's heads per rank say the same.
- Only nn.Linear, Conv1D (as its linear), QuantizedLinear (with its scales, quantized.py),
  nn.Embedding and the expert modules of transformers' standard layout are split;
  anything else a rule names is refused at load, naming it.
- Column-split projections have a row-split one beside them (same parent module) and
  the reverse; else the module is refused, naming it (``check_pairs``).
"""

from __future__ import annotations

import dataclasses
import re

import torch
import transformers
from torch import nn

from ..model.adapters.qwen4_exp import QSA_MODEL_TYPES, index_columns
from ..model.kv_cache_spec import KVCacheSpec
from ..quantization.experts import QuantizedExperts
from ..quantization.linear import QuantizedLinear
from ..surgery import replace
from .experts import split_float_experts, split_quantized_experts, splits_unnamed
from .fused import (
    FUSED,
    FUSED_ATTENTION,
    PACKED_ADAPTER,
    as_linear,
    fused_layout,
    fused_rules,
    fused_share,
    set_fused_sizes,
)
from .group import RankGroup, ShardingError
from .grouped_output import GROUPED, GROUPED_OUTPUT, set_local_groups, split_grouped_linear
from .heads import Heads, heads_at, layer_heads, model_heads, set_local_heads, span_norms
from .layers import GatheredLMHead, VocabParallelEmbedding, column_share, row_share
from .recurrent import recurrent_mixer_names, shard_recurrent_mixers
from .vlm import encoder_prefixes

COLUMN, ROW, PACKED_COLUMN, EXPERTS, EMBEDDING, WHOLE = "colwise", "rowwise", "packed_colwise", "experts", \
    "embedding", "whole"
PACKED = (PACKED_COLUMN, PACKED_ADAPTER)  # [gate | up] rows (an adapter's too: fused.py)
# transformers' plan styles, as the splits they ask for.
SPLIT_INPUT = "split_input"
PLAN_STYLES = {
    "colwise": COLUMN, "rowwise": ROW, "packed_colwise": PACKED_COLUMN, "moe_tp_experts": EXPERTS,
    "embedding_rowwise": EMBEDDING, "colwise_gather_output": WHOLE, "replicated_with_grad_allreduce": WHOLE,
    "replicate": WHOLE, "mla_kv_a_proj": WHOLE, "embedding_colwise": WHOLE, "rowwise_split_input": SPLIT_INPUT,
}
# The expert-parallel plan's style for an experts module (base_model_ep_plan).
EP_EXPERTS = "ep_dispatch_experts"
# Shape rules for the names a plan leaves out (or a model without a plan).
ATTENTION_COLUMN = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj")
SHAPE_RULES = {**dict.fromkeys(ATTENTION_COLUMN, COLUMN), "o_proj": ROW,
               "gate_proj": COLUMN, "up_proj": COLUMN, "down_proj": ROW}
KEY_VALUE = ("k_proj", "v_proj")
# An attention module's output projection under names the shape rules cannot take for
# every model (an MLP's or a mixer's output is called so too): row-split only beside
# q_proj, k_proj and v_proj (OPT, GPT-Neo, XGLM, BioGPT, LFM2, ModernBERT-decoder).
ATTENTION_OUTPUT = ("out_proj", "Wo")


def shard_cache_spec(spec: KVCacheSpec, hf_config: transformers.PretrainedConfig, size: int) -> KVCacheSpec:
    """The cache one of ``size`` ranks keeps: each attention layer's key-value heads of
    that rank (a latent cache, one "head" every head reads, whole on each rank). A
    Qwen4-exp indexed layer's index key, spread over the columns its heads keep after
    their values, is whole on every rank: spread over the rank's heads."""
    heads = model_heads(hf_config)
    text_config = hf_config.get_text_config()
    types = getattr(text_config, "layer_types", None) or []
    layers = []
    for index, layer in enumerate(spec.layers):
        if layer.num_kv_heads and heads is not None and layer.value_head_dim:
            share = layer.num_kv_heads // size if layer.num_kv_heads >= size else 1
            value_head_dim = layer.value_head_dim
            if text_config.model_type in QSA_MODEL_TYPES and index < len(types) and types[index] == "indexed_attention":
                value_head_dim += index_columns(text_config, share) - index_columns(text_config, layer.num_kv_heads)
            layer = dataclasses.replace(layer, num_kv_heads=share, value_head_dim=value_head_dim)
        layers.append(layer)
    return dataclasses.replace(spec, layers=tuple(layers))


def plan_rules(model: nn.Module) -> list[tuple[re.Pattern[str], str]]:
    """The model's plan as (pattern over module names, split) pairs; ShardingError for
    a style not split here."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if isinstance(config, transformers.PretrainedConfig) else None
    plan = dict(getattr(text_config, "base_model_tp_plan", None) or {})
    # The experts modules the expert-parallel plan dispatches to (transformers from 5.25
    # names them there only) are split tensor-parallel, as the plan's "moe_tp_experts".
    ep_plan = getattr(text_config, "base_model_ep_plan", None) or {}
    plan.update({key: "moe_tp_experts" for key, style in ep_plan.items()
                 if style == EP_EXPERTS and key not in plan})
    rules = []
    for key, style in plan.items():
        if style not in PLAN_STYLES:
            model_type = getattr(text_config, "model_type", type(model).__name__)
            raise ShardingError(f"{model_type}'s tensor-parallel plan splits {key!r} as {style!r}, "
                                "which shardline's ranks do not run")
        pattern = re.escape(key).replace(r"\*", r"\d+")
        rules.append((re.compile(rf"(?:^|\.){pattern}$"), PLAN_STYLES[style]))
    resolved = by_name(split_input_rules(model, rules))  # ahead of the plan's patterns, which they resolve
    fused = by_name(fused_rules(model, recurrent_mixer_names(model) + encoder_prefixes(model)))  # by heads: first
    return [*fused, *resolved, *rules, *by_name(attention_rules(model))]


def by_name(named: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    """Rules matching exactly the module names of ``named``, one per split."""
    rules = []
    for split in dict.fromkeys(named.values()):
        names = [name for name, rule in named.items() if rule == split]
        rules.append((re.compile("^(?:" + "|".join(map(re.escape, names)) + ")$"), split))
    return rules


def split_input_rules(model: nn.Module, rules: list[tuple[re.Pattern[str], str]]) -> dict[str, str]:
    """Splits, by module name, for the plan's ``rowwise_split_input`` projections, whose
    input transformers gathers whole first (the projections feeding them planned
    ``colwise_gather_output``: OLMo's q/k/v before norms over all heads, a fused
    gate_up_proj before its chunk). The ranks keep the input as the rank's share instead:
    an attention output beside q/k/v_proj is row-split with them column-split by heads
    (norms over all heads span the ranks: attention_norms.py), a down_proj beside a
    gate_up_proj row-split with it packed column-split; any other (a low-rank mixing
    weight over the whole residual, qwen4_exp's hyper-connections) runs whole on every
    rank, as its input is."""
    resolved: dict[str, str] = {}
    for name, _ in model.named_modules():
        if next((split for pattern, split in rules if pattern.search(name)), None) != SPLIT_INPUT:
            continue
        parent_name, _, leaf = name.rpartition(".")
        children = dict(model.get_submodule(parent_name).named_children())
        prefix = f"{parent_name}." if parent_name else ""
        if all(part in children for part in ATTENTION_COLUMN[:3]):
            resolved.update({prefix + part: COLUMN for part in ATTENTION_COLUMN[:3]})
            resolved[name] = ROW
        elif leaf == "down_proj" and "gate_up_proj" in children:
            resolved.update({prefix + "gate_up_proj": PACKED_COLUMN, name: ROW})
        else:
            resolved[name] = WHOLE
    return resolved


def attention_rules(model: nn.Module) -> dict[str, str]:
    """Splits of attention parts whose names the shape rules cannot take for every
    model, by module name: an output projection named ``ATTENTION_OUTPUT`` beside
    q_proj, k_proj and v_proj (row-wise), and a per-head output gate ``g_proj`` (one
    output per query head, bailing_hybrid) beside split query and key projections
    (column-wise: each rank's heads' gates), and DeepSeek-V4's grouped output projection
    beside q_b_proj (by groups of heads, its mix row-wise; its compressors whole).
    Recurrent mixers keep their own parts."""
    mixers = recurrent_mixer_names(model)
    config = getattr(model, "config", None)
    heads = model_heads(config) if isinstance(config, transformers.PretrainedConfig) else None
    named = {}
    for name, module in model.named_modules():
        if f"{name}.".startswith(mixers):
            continue
        children = dict(module.named_children())
        prefix = f"{name}." if name else ""
        if all(leaf in children for leaf in ATTENTION_COLUMN[:3]):
            named.update({prefix + leaf: ROW for leaf in ATTENTION_OUTPUT if leaf in children})
        if all(leaf in children for leaf in GROUPED_OUTPUT):  # the heads' groups, then their mix (grouped_output.py)
            named.update({prefix + "o_a_proj": GROUPED, prefix + "o_b_proj": ROW})
            # its compressors and indexer read the whole hidden state for the one key head: whole
            compressor = children.get("compressor")
            if compressor is not None:
                named.update({f"{prefix}compressor.{sub}": WHOLE for sub, _ in compressor.named_modules() if sub})
        gate = children.get("g_proj")
        if (heads is not None and gate is not None and getattr(gate, "out_features", None) == heads.num_heads
                and {"q_proj", "q_b_proj"} & set(children) and {"k_proj", "kv_b_proj"} & set(children)):
            named[prefix + "g_proj"] = COLUMN
    return named


def split_of(name: str, rules: list[tuple[re.Pattern[str], str]]) -> str | None:
    """The split the plan names for module ``name``, else the shape rule's (None: whole)."""
    for pattern, split in rules:
        if pattern.search(name):
            return split
    return SHAPE_RULES.get(name.rsplit(".", 1)[-1])


def column_rows(linear: nn.Linear | QuantizedLinear, name: str, group: RankGroup, heads: Heads | None,
                packs: int) -> slice | torch.Tensor:
    """The output rows of ``linear`` this rank keeps: an equal share of each of its
    ``packs`` concatenated parts (a key-value projection with fewer heads than ranks:
    the one head this rank's queries read)."""
    out = linear.out_features
    leaf = name.rsplit(".", 1)[-1]
    if leaf in KEY_VALUE and heads is not None and heads.num_kv_heads < group.size and out % heads.num_kv_heads == 0:
        head_dim = out // heads.num_kv_heads
        first, _ = heads.kv_head_of(group.rank, group.size)
        return slice(first * head_dim, (first + 1) * head_dim)
    if out % (packs * group.size):
        raise ShardingError(f"{name}: {out} output features do not split over {group.size} ranks")
    part, share = out // packs, out // packs // group.size
    starts = [p * part + group.rank * share for p in range(packs)]
    return torch.cat([torch.arange(start, start + share) for start in starts]) if packs > 1 else \
        slice(starts[0], starts[0] + share)


def shard_model(model: nn.Module, group: RankGroup, num_attention_layers: int) -> int:
    """The surgery step: replace each module the plan or the shape rules split by this
    rank's share of it (``group``), the input embedding and the LM head by their
    vocabulary-parallel forms, and set the attention modules' head counts to this
    rank's; return how many modules were replaced. ShardingError, naming the module,
    where a split cannot be made exactly, or where fewer attention layers than the
    model's ``num_attention_layers`` were split (a projection no rule knows)."""
    config = getattr(model, "config", None)
    heads = model_heads(config) if isinstance(config, transformers.PretrainedConfig) else None
    per_layer = layer_heads(config) if isinstance(config, transformers.PretrainedConfig) else ()
    rules = plan_rules(model)
    replaced = len(shard_recurrent_mixers(model, group))
    mixers = recurrent_mixer_names(model)  # split by their own rules above, or run whole: no name rule applies
    mixers += encoder_prefixes(model)  # a vision-language model's encoders: whole on every rank (vlm.py)
    attention, splits, fused = set(), {}, {}
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if f"{name}.".startswith(mixers):
            continue
        # Quantized experts, and gpt-oss's float ones, split whether or not a rule names them (its plan does not).
        split = EXPERTS if splits_unnamed(module) else split_of(name, rules)
        if leaf in FUSED_ATTENTION and split != FUSED:
            raise ShardingError(f"{name}: a fused query-key-value projection ({type(module).__name__}) "
                                "is not split over ranks")
        if split is None or split == WHOLE or split == EMBEDDING:
            continue
        if split == FUSED:  # by its attention's heads, in its layout (fused.py)
            fused[name.rpartition(".")[0]] = layout = fused_layout(model.get_submodule(name.rpartition(".")[0]),
                                                                   name, config)
            new = fused_share(module, name, layout, group)
        else:
            new = split_module(module, name, split, group, heads_at(name, heads, per_layer))
        if new is not None:
            replace(model, name, new)
            replaced += 1
            splits[name] = COLUMN if split == FUSED else split
            if leaf in ATTENTION_COLUMN or split == FUSED:
                attention.add(name.rsplit(".", 1)[0])
    check_pairs(splits)
    replaced += split_vocabulary(model, group)
    for name in attention:
        set_local_heads(model.get_submodule(name), heads_at(name, heads, per_layer), group)
        replaced += span_norms(model.get_submodule(name), name, heads_at(name, heads, per_layer), group)
        set_local_groups(model.get_submodule(name))
        if name in fused:
            set_fused_sizes(model.get_submodule(name), fused[name], group)
    if len(attention) < num_attention_layers:
        raise ShardingError(f"{type(model).__name__}: {len(attention)} of its {num_attention_layers} attention "
                            "layers have projections the tensor-parallel rules split (q/k/v_proj, q_b_proj, "
                            "kv_b_proj or its plan's)")
    return replaced


def check_pairs(splits: dict[str, str]) -> None:
    """Refuse, naming them, column-split projections with no row-split one beside them
    (in the same parent module), or the reverse: the projection they feed (or that feeds
    them) has a name no rule splits, such as Zamba2's fused ``gate_up_proj``, so it
    would stay whole and meet a rank's share."""
    by_parent: dict[str, dict[bool, list[str]]] = {}
    for name, split in splits.items():
        if split in (COLUMN, PACKED_COLUMN, ROW):
            parent, _, leaf = name.rpartition(".")
            by_parent.setdefault(parent, {True: [], False: []})[split == ROW].append(leaf)
    for parent, sides in by_parent.items():
        if sides[False] and not sides[True]:
            raise ShardingError(f"{parent}: {', '.join(sides[False])} split column-wise, but the projection they "
                                "feed is one no tensor-parallel rule splits row-wise; not split over ranks")
        if sides[True] and not sides[False]:
            raise ShardingError(f"{parent}: {', '.join(sides[True])} split row-wise, but the projection feeding "
                                "it is one no tensor-parallel rule splits column-wise; not split over ranks")


def split_module(module: nn.Module, name: str, split: str, group: RankGroup, heads: Heads | None) -> nn.Module | None:
    """This rank's share of ``module`` under ``split`` (None: a name the rule matches
    that is no module to split, such as a plan entry for a parameter)."""
    if split == EXPERTS:
        if isinstance(module, QuantizedExperts):
            return split_quantized_experts(module, name, group)
        return split_float_experts(module, name, group)
    module = as_linear(module)  # a Conv1D (GPT-2's) as the linear of its product
    if not isinstance(module, (nn.Linear, QuantizedLinear)):  # a quantized one splits with its scales
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) or not any(True for _ in module.parameters()):
            return None
        raise ShardingError(f"{name}: a {type(module).__name__} the rule {split!r} names is not an nn.Linear; "
                            "it is not split over ranks")
    if split == GROUPED:
        return split_grouped_linear(module, name, group)
    if split == ROW:
        return row_share(module, name, group)
    return column_share(module, name, column_rows(module, name, group, heads, 2 if split in PACKED else 1),
                        group)


def split_vocabulary(model: nn.Module, group: RankGroup) -> int:
    """Replace the input embedding (a plain nn.Embedding) and the LM head (an nn.Linear)
    by their vocabulary-parallel forms; return how many were replaced. A subclass
    (a scaled embedding) stays whole on every rank."""
    names = {id(module): name for name, module in model.named_modules()}
    replaced = 0
    get_input, get_output = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding = get_input() if callable(get_input) else None
    if type(embedding) is nn.Embedding and id(embedding) in names and not encoder_prefixes(model):  # a VLM's: whole
        replace(model, names[id(embedding)], VocabParallelEmbedding(embedding, group))
        replaced += 1
    head = get_output() if callable(get_output) else None
    if type(head) is nn.Linear and id(head) in names:
        replace(model, names[id(head)], GatheredLMHead(head, group))
        replaced += 1
    return replaced
