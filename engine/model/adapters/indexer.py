"""A latent attention layer's sparse-attention indexer (DeepSeek Sparse Attention:
deepseek_v32, glm_moe_dsa, axk2, hy_v4, dots3_note), run on the engine's paged cache of
index keys.

The indexer is the original layer's own ``indexer`` submodule (wq_b, wk, k_norm,
weights_proj), which the latent adapter takes over; this module computes its index
queries, keys and head weights from them in transformers' order (queries from the
layer's query LoRA output, keys layer-normed, the rotary part first and rotated by the
layer type's indexer rotation), writes the keys into the layer's index-key cache and
selects each query's keys (engine/attention/sparse_index.py).

glm_moe_dsa's "shared" layers have no indexer: they attend what the previous layer
with one selected in the same step (kept on the model's StepScope, cleared per step).
dots3_note's sliding-window layers select nothing: they attend their window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

from ...attention.context import AttentionContext
from ...attention.sparse_index import Selection, select_keys, write_index_keys
from .base import StepScope, UnsupportedAttentionError, layer_attribute, layer_scale

# (q [1, H, T, dr], k [1, 1, T, dr], the call's position embeddings) -> rotated (q, k)
Rotate = Callable[[torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class IndexerLayout:
    """Where one type's indexer departs from deepseek_v32's.

    rotation: how its rotary part turns ("half", "interleave" or "own", as latent layouts
    name it).
    rope_last: the rotary part is each index head's last qk_rope_head_dim numbers, not its
    first (hy_v4).
    scale_on_weights: the softmax scale multiplies the head weights instead of each
    head's score (hy_v4), a different rounding of the same product."""

    rotation: str
    rope_last: bool = False
    scale_on_weights: bool = False


def layer_selects(text_config: transformers.PretrainedConfig, layer_index: int) -> bool:
    """Whether the layer attends a selection of keys: every layer of a sparse attention,
    except those its ``layer_types`` name otherwise (dots3_note's "sliding_attention"
    layers attend a window of keys, with no indexer)."""
    kinds = getattr(text_config, "layer_types", None)
    return kinds is None or kinds[layer_index] == "indexed_attention"


def runs_indexer(text_config: transformers.PretrainedConfig, layer_index: int) -> bool:
    """Whether the layer runs an indexer of its own (glm_moe_dsa's ``indexer_types``
    name "shared" layers that reuse the previous one's selection)."""
    indexer_types = getattr(text_config, "indexer_types", None)
    return layer_selects(text_config, layer_index) and (indexer_types is None or indexer_types[layer_index] == "full")


def index_key_width(text_config: transformers.PretrainedConfig, layer_index: int) -> int:
    """Numbers per token of the layer's index-key cache (0 for a layer without indexer)."""
    return text_config.index_head_dim if runs_indexer(text_config, layer_index) else 0


class LayerIndexer:
    """One layer's indexer over its index-key cache (see the module docstring)."""

    def __init__(self, owner: nn.Module, layer_idx: int, layout: IndexerLayout, rotate: Rotate,
                 scope: StepScope) -> None:
        indexer = owner.get_submodule("indexer")
        self._owner = (owner,)  # the adapter holding the indexer's modules (not registered twice)
        self.layer_idx = layer_idx
        self.heads = layer_attribute(indexer, "n_heads", int)
        self.head_dim = layer_attribute(indexer, "head_dim", int)
        self.rope_dim = layer_attribute(indexer, "qk_rope_head_dim", int)
        self.topk = layer_attribute(indexer, "index_topk", int)
        self.scale = layer_scale(indexer, "softmax_scale")
        if self.topk < 1:
            raise UnsupportedAttentionError(f"attention layer {layer_idx}: index_topk is {self.topk}; "
                                            "the indexer keeps at least one key")
        self._rotate = rotate
        self._scope = scope
        self.layout = layout

    def select(self, ctx: AttentionContext, x: torch.Tensor, q_resid: torch.Tensor,
               position_embeddings: object) -> list[Selection]:
        """Write the step's index keys (x [T, hidden], q_resid [T, q_lora_rank]) into
        the layer's index-key cache and return each request's selection; the selection
        is kept for the shared layers after this one."""
        module = self._owner[0].get_submodule
        num_tokens = x.shape[0]
        q_index = module("indexer.wq_b")(q_resid).view(num_tokens, self.heads, self.head_dim)
        k_norm = module("indexer.k_norm")  # in its weight's dtype (hy_v4 keeps it in float32)
        k_index = k_norm(module("indexer.wk")(x).to(_weight_dtype(k_norm, x.dtype))).to(x.dtype)  # [T, D]
        q_index, k_index = self._rotated(q_index, k_index, position_embeddings)
        weights_proj = module("indexer.weights_proj")
        head_weights = weights_proj(x.to(_weight_dtype(weights_proj, x.dtype))).float() * (self.heads ** -0.5)
        scale = self.scale
        if self.layout.scale_on_weights:
            head_weights, scale = head_weights * self.scale, 1.0
        index_cache = ctx.kv_caches[self.layer_idx][1]
        write_index_keys(index_cache, k_index, ctx.slot_mapping)
        selections = select_keys(q_index, head_weights, index_cache, ctx.query_start_loc, ctx.seq_lens,
                                 ctx.block_tables, self.topk, scale)
        self._scope.index_selections = selections
        return selections

    def _rotated(self, q_index: torch.Tensor, k_index: torch.Tensor,
                 position_embeddings: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries [T, H, D] and keys [T, D] with their rotary part rotated: the
        first rope_dim numbers of each, or the last (``rope_last``)."""
        split = self.head_dim - self.rope_dim if self.layout.rope_last else self.rope_dim
        q_first, q_second = q_index.split([split, self.head_dim - split], dim=-1)
        k_first, k_second = k_index.split([split, self.head_dim - split], dim=-1)
        q_part, k_part = (q_second, k_second) if self.layout.rope_last else (q_first, k_first)
        q_rot, k_rot = self._rotate(q_part.transpose(0, 1)[None], k_part[None, None], position_embeddings)
        q_rot, k_rot = q_rot[0].transpose(0, 1), k_rot[0, 0]
        if self.layout.rope_last:
            return torch.cat([q_first, q_rot], dim=-1), torch.cat([k_first, k_rot], dim=-1)
        return torch.cat([q_rot, q_second], dim=-1), torch.cat([k_rot, k_second], dim=-1)


def _weight_dtype(module: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype of the module's weight (its input is cast to it), else ``default``."""
    weight = getattr(module, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else default


def shared_selections(scope: StepScope, layer_idx: int) -> list[Selection]:
    """A shared layer's selections: those of the last layer with an indexer in the
    running step."""
    if scope.index_selections is None:
        raise UnsupportedAttentionError(f"attention layer {layer_idx} reuses the previous layer's key selection, "
                                        "but no layer before it selected keys in this step")
    return scope.index_selections
