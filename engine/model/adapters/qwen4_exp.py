"""Qwen4-exp's query-sparse attention (QSA) layers on the engine's paged cache.

Each "indexed_attention" layer is a gated grouped-query attention whose queries see only
the tokens an indexer picks: every token writes one index key; for a query at position
p the complete blocks of ``indexer_compress_ratio`` tokens at or before p are scored
against its index query heads through each block's pooled key (the block's index keys
averaged in float32, normed and rotated at the block's first position), and the query
attends the tokens of its top ``indexer_budget // indexer_compress_ratio`` blocks plus
the tokens after its last complete block, as transformers' indexer selects them.

Cache: the layer's keys in the key cache; its values in the value cache, each token's
index key packed after them (``index_columns`` extra numbers per key-value head). A
block's pooled key is recomputed from the cached index keys whenever a query ranks it:
it depends on the block's tokens alone, so chunked prefill, prefix hits and preemption
need nothing more. Scores, selection and attention run in torch, per request.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
import transformers
from torch import nn

from ...attention.context import AttentionContext
from ...attention.sparse_compressed import read_rows, write_rows
from .base import StepScope, UnsupportedAttentionError, _Replacement, layer_attribute, layer_scale

QSA_MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")


def index_columns(text_config: transformers.PretrainedConfig, num_kv_heads: int) -> int:
    """Numbers per key-value head after a QSA layer's values that hold its index key."""
    return -(-text_config.indexer_head_dim // num_kv_heads)


def qsa_refusal(text_config: transformers.PretrainedConfig) -> str | None:
    """Why a QSA model cannot run, or None."""
    if getattr(text_config, "ple_layer_ids", None):
        return (f"layers {text_config.ple_layer_ids} (ple_layer_ids) embed hashed n-grams of each token's previous "
                f"{text_config.ngram_size - 1} token ids and convolve over a dilated span of earlier tokens, state "
                "the engine keeps for no layer")
    if text_config.indexer_kv_heads != 1:
        return (f"indexer_kv_heads is {text_config.indexer_kv_heads}; its indexer (and transformers' own) keeps one "
                "index key per token")
    return None


def block_selection(q_index: torch.Tensor, pooled: torch.Tensor, positions: torch.Tensor, ratio: int,
                    block_topk: int, seq_len: int) -> torch.Tensor:
    """[n, seq_len] bool: the tokens each query attends. q_index [n, H, D] (normed and
    rotated), pooled [B, D] the complete blocks' keys (rotated), positions [n]. Each
    query's scores are computed as transformers does, over the blocks it sees alone."""
    selected = torch.zeros(q_index.shape[0], seq_len, dtype=torch.bool, device=q_index.device)
    for row, position in enumerate(positions.tolist()):
        visible = (position + 1) // ratio
        if visible:
            scores = torch.matmul(q_index[row].float(), pooled[:visible].float().transpose(-1, -2)).transpose(-1, -2)
            scores = torch.relu(scores).sum(dim=-1) / math.sqrt(q_index.shape[-1])  # [visible]
            best = scores.topk(min(block_topk, visible), dim=0).indices
            tokens = (best[:, None] * ratio + torch.arange(ratio, device=best.device)[None, :]).flatten()
            selected[row, tokens] = True
        selected[row, visible * ratio:position + 1] = True
    return selected


class QuerySparseAttention(_Replacement):
    """A Qwen4-exp indexed attention layer (see the module docstring)."""

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self.cache_layer = layer_idx
        self.head_dim = layer_attribute(original, "head_dim", int)
        self.scale = layer_scale(original, "scaling")
        indexer = original.get_submodule("indexer")
        self.index_head_dim = layer_attribute(indexer, "index_head_dim", int)
        self.index_query_width = layer_attribute(indexer, "index_n_heads", int) * self.index_head_dim
        self.ratio = layer_attribute(indexer, "compress_ratio", int)
        self.block_topk = layer_attribute(indexer, "block_topk", int)
        if layer_attribute(indexer, "index_kv_heads", int) != 1:
            raise UnsupportedAttentionError(f"attention layer {layer_idx}: its indexer keeps more than one index "
                                            "key per token")
        self.indexed = True
        modeling = sys.modules[type(original).__module__]
        # transformers' partial rotation (first rotary_dim numbers): (q, k=None, cos, sin, unsqueeze_dim).
        self._rotate: Callable[..., torch.Tensor] = modeling.apply_rotary_pos_emb
        config = layer_attribute(original, "config", transformers.PretrainedConfig)
        # The model's rotary embedding, again: blocks' first positions are rotated as the
        # model rotates any position (kept unregistered: no parameters, no state).
        self._rotary = (modeling.Qwen4ExpTextRotaryEmbedding(config=config),)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, **kwargs):
        ctx = self._scope.ctx or kwargs.get("shardline_ctx")
        if ctx is None:
            return self.original(hidden_states, position_embeddings, attention_mask, **kwargs)
        module = self.get_submodule
        num_tokens = hidden_states.shape[1]
        cos, sin = (part[:, -num_tokens:, :] for part in position_embeddings)
        query, gate = torch.chunk(module("q_proj")(hidden_states).view(1, num_tokens, -1, self.head_dim * 2), 2, -1)
        query = module("q_norm")(query.reshape(1, num_tokens, -1, self.head_dim)).transpose(1, 2)
        key = module("k_norm")(module("k_proj")(hidden_states).view(1, num_tokens, -1, self.head_dim)).transpose(1, 2)
        value = module("v_proj")(hidden_states).view(1, num_tokens, -1, self.head_dim)[0]  # [T, Hkv, D]
        query, key = self._rotate(query, key, cos, sin)  # [1, H, T, D], [1, Hkv, T, D]
        q_index, k_index = module("indexer.index_qk_proj")(hidden_states).split(
            [self.index_query_width, self.index_head_dim], dim=-1)  # [1, T, Hi * Di], [1, T, Di]
        q_index = module("indexer.q_layernorm")(q_index.reshape(1, num_tokens, -1, self.index_head_dim))
        q_index = self._rotate(q_index, cos=cos, sin=sin, unsqueeze_dim=2)[0]  # [T, Hi, Di]
        key_cache, value_cache = ctx.kv_caches[self.cache_layer]
        kv_heads = key_cache.shape[2]
        write_rows(key_cache, key[0].transpose(0, 1).reshape(num_tokens, -1), ctx.slot_mapping)
        padded = k_index[0].new_zeros(num_tokens, kv_heads * (value_cache.shape[-1] - self.head_dim))
        padded[:, :self.index_head_dim] = k_index[0]
        rows = torch.cat([value, padded.view(num_tokens, kv_heads, -1)], dim=-1)
        write_rows(value_cache, rows.reshape(num_tokens, -1), ctx.slot_mapping)
        out = self._attend(ctx, query[0].transpose(0, 1), q_index)  # [T, H, D]
        out = out.reshape(1, num_tokens, -1) * torch.sigmoid(gate.reshape(1, num_tokens, -1))
        return module("o_proj")(out), None

    def _pooled_keys(self, index_keys: torch.Tensor, num_blocks: int, like: torch.Tensor) -> torch.Tensor:
        """The complete blocks' keys [B, Di]: index keys averaged, normed, rotated at each
        block's first position."""
        blocks = index_keys[:num_blocks * self.ratio].view(num_blocks, self.ratio, self.index_head_dim)
        pooled = blocks.float().mean(dim=1)
        pooled = self.get_submodule("indexer.k_layernorm")(pooled.to(index_keys.dtype))
        starts = torch.arange(num_blocks, device=index_keys.device)[None] * self.ratio
        rotary = self._rotary[0].to(index_keys.device)
        cos, sin = rotary(like, starts)
        return self._rotate(pooled.unsqueeze(1), cos=cos[0], sin=sin[0]).squeeze(1)

    def _attend(self, ctx: AttentionContext, query: torch.Tensor, q_index: torch.Tensor) -> torch.Tensor:
        """Each request's attention over the tokens its queries select: query [T, H, D] -> [T, H, D]."""
        key_cache, value_cache = ctx.kv_caches[self.cache_layer]
        kv_heads = key_cache.shape[2]
        out = torch.empty_like(query)
        starts, lens = ctx.query_start_loc.tolist(), ctx.seq_lens.tolist()
        for request, seq_len in enumerate(lens):
            begin, finish = starts[request], starts[request + 1]
            if finish == begin:
                continue
            table = ctx.block_tables[request]
            keys = read_rows(key_cache, table, 0, seq_len).view(seq_len, kv_heads, self.head_dim)
            rows = read_rows(value_cache, table, 0, seq_len).view(seq_len, kv_heads, -1)
            values = rows[..., :self.head_dim]
            index_keys = rows[..., self.head_dim:].reshape(seq_len, -1)[:, :self.index_head_dim]
            positions = torch.arange(seq_len - (finish - begin), seq_len, device=query.device)
            pooled = self._pooled_keys(index_keys, seq_len // self.ratio, query)
            selected = block_selection(q_index[begin:finish], pooled, positions, self.ratio, self.block_topk, seq_len)
            out[begin:finish] = _masked_attention(query[begin:finish], keys, values, selected, self.scale)
        return out


def _masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, selected: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """query [n, H, D] over keys, values [S, Hkv, D] where selected [n, S]; -> [n, H, D].
    The ops (and roundings) of transformers' eager attention: scaled scores in the model's
    dtype, the masked ones at its lowest value, softmax in float32."""
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    logits = torch.matmul(query.transpose(0, 1), keys.permute(1, 2, 0)) * scale  # [H, n, S]
    logits = logits.masked_fill(~selected[None], torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values.transpose(0, 1)).transpose(0, 1)
