"""DeepSeek-V4's attention layers on the engine's paged cache.

Every layer makes one shared key/value head (keys double as values), attends with
learned sinks over a sliding window of raw keys, de-rotates its output's rotary part
and projects it through grouped low-rank projections. Its "sliding_attention" layers
attend the window alone, through the engine's paged attention (windowed groups and
kernels as any windowed layer). Its "compressed_sparse_attention" (CSA) and "heavily_compressed_attention" (HCA) layers
add keys that learned compressors pool over blocks of ``compress_rates[layer type]``
tokens, and a CSA layer's indexer keeps the top ``index_topk`` of them per query
(engine/attention/sparse_compressed.py has the math and the cache rows). This adapter
computes queries and the shared key/value with the original's own modules, writes the
raw keys into the layer's key cache and each token's compressor projections into its
value cache, pools every block the step completes, selects, attends and applies the
original's output de-rotation and grouped output projection.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import transformers
from torch import nn

from ...attention.context import AttentionContext, paged_attention_forward
from ...attention.sparse_compressed import (
    PooledSeries,
    attend_window_and_entries,
    pack_rows,
    pool_blocks,
    read_rows,
    select_entries,
    slots_of,
    visible_entries,
    write_rows,
)
from .base import StepScope, _Replacement, layer_attribute, layer_scale

COMPRESSED_SPARSE = "compressed_sparse_attention"
HEAVILY_COMPRESSED = "heavily_compressed_attention"
COMPRESSED_TYPES = (COMPRESSED_SPARSE, HEAVILY_COMPRESSED)
# Model types whose layers this adapter runs.
COMPRESSED_MODEL_TYPES = ("deepseek_v4",)


def row_series(text_config: transformers.PretrainedConfig, layer_type: str) -> list[PooledSeries]:
    """The pooled series a compressed layer's value-cache row holds: its compressor's
    (head_dim wide entries) and, in a CSA layer, its indexer's (index_head_dim)."""
    if layer_type == HEAVILY_COMPRESSED:
        return [PooledSeries(0, text_config.head_dim, overlap=False)]
    compressor = PooledSeries(0, text_config.head_dim, overlap=True)
    return [compressor, PooledSeries(compressor.row_width, text_config.index_head_dim, overlap=True)]


def compressed_row_width(text_config: transformers.PretrainedConfig, layer_type: str) -> int:
    """Numbers per token of a compressed layer's value cache (0 for another layer)."""
    if layer_type not in COMPRESSED_TYPES:
        return 0
    return sum(series.row_width for series in row_series(text_config, layer_type))


class CompressedAttention(_Replacement):
    """A DeepSeek-V4 attention layer (see the module docstring)."""

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self.cache_layer = layer_idx
        self.layer_type = layer_attribute(original, "layer_type", str)
        self.rope_layer_type = layer_attribute(original, "rope_layer_type", str)
        config = layer_attribute(original, "config", transformers.PretrainedConfig)
        self.head_dim = layer_attribute(original, "head_dim", int)
        self.window = layer_attribute(original, "sliding_window", int)
        self.scale = layer_scale(original, "scaling")
        self.o_groups = int(config.o_groups)
        self.rate = int(config.compress_rates[self.layer_type]) if self.layer_type in COMPRESSED_TYPES else 0
        self.series = row_series(config, self.layer_type) if self.rate else []
        self.row_width = sum(series.row_width for series in self.series)
        self.indexed = self.layer_type == COMPRESSED_SPARSE  # its indexer picks each query's entries
        # The compressors' modules (the compressor, then a CSA layer's indexer) by name.
        self.poolers = ["compressor", "compressor.indexer"][:len(self.series)]
        if self.layer_type == COMPRESSED_SPARSE:
            indexer = original.get_submodule("compressor.indexer")
            self.index_head_dim = layer_attribute(indexer, "head_dim", int)
            self.index_topk = layer_attribute(indexer, "index_topk", int)
            self.index_scale = layer_scale(indexer.get_submodule("scorer"), "softmax_scale")
            self.index_weights_scale = layer_scale(indexer.get_submodule("scorer"), "weights_scaling")
        # transformers' interleaved rotation of a tensor's trailing rotary slice, from
        # the original's own modeling module: (x, cos, sin) -> rotated x.
        self._rotate: Callable[..., torch.Tensor] = sys.modules[type(original).__module__].apply_rotary_pos_emb

    def forward(self, hidden_states: torch.Tensor, position_embeddings: dict, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, **kwargs):
        ctx = self._scope.ctx or kwargs.get("shardline_ctx")
        if ctx is None:
            return self.original(hidden_states, position_embeddings, position_ids, attention_mask, **kwargs)
        module = self.get_submodule
        cos, sin = position_embeddings[self.rope_layer_type]
        num_tokens = hidden_states.shape[1]
        q_residual = module("q_a_norm")(module("q_a_proj")(hidden_states))
        q = module("q_b_proj")(q_residual).view(1, num_tokens, -1, self.head_dim).transpose(1, 2)
        q = self._rotate(module("q_b_norm")(q), cos, sin)  # [1, H, T, D]
        kv = module("kv_norm")(module("kv_proj")(hidden_states)).view(1, num_tokens, -1, self.head_dim)
        kv = self._rotate(kv.transpose(1, 2), cos, sin)  # [1, 1, T, D]
        sinks = self.get_parameter("sinks")
        if self.rate:
            key_cache, row_cache = ctx.kv_caches[self.cache_layer]
            write_rows(key_cache, kv[0, 0], ctx.slot_mapping)
            projections = [(module(f"{name}.kv_proj")(hidden_states[0]), module(f"{name}.gate_proj")(hidden_states[0]))
                           for name in self.poolers]
            write_rows(row_cache, pack_rows(self.series, projections, self.row_width), ctx.slot_mapping)
            out = self._attend(ctx, q[0].transpose(0, 1), hidden_states, q_residual, position_ids, sinks)
        else:  # a sliding layer: windowed attention with sinks, keys doubling as values
            out = paged_attention_forward(self, q, kv, kv, None, scaling=self.scale, sliding_window=self.window,
                                          shardline_ctx=ctx, s_aux=sinks)[0][0]
        out = self._rotate(out[None].transpose(1, 2), cos, -sin).transpose(1, 2)  # out: [T, H, D]
        grouped = module("o_a_proj")(out.reshape(1, num_tokens, self.o_groups, -1)).flatten(2)
        return module("o_b_proj")(grouped), None

    def _pool_new_blocks(self, row_cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int) -> None:
        """Write the entries of the blocks whose last token is among positions start .. end - 1."""
        first, last = start // self.rate, end // self.rate
        if last <= first:
            return
        block_starts = torch.arange(first, last, device=row_cache.device) * self.rate
        entry_slots = slots_of(block_table, block_starts + self.rate - 1, row_cache.shape[1])
        for series, name in zip(self.series, self.poolers, strict=True):
            lead = 1 if series.overlap and first > 0 else 0
            rows = read_rows(row_cache, block_table, (first - lead) * self.rate, last * self.rate)
            kv, gate = series.projections(rows)
            pooled = pool_blocks(kv, gate, self.get_parameter(f"{name}.position_bias"), self.rate, first,
                                 last - first, series.overlap)
            entries = self.get_submodule(f"{name}.kv_norm")(pooled)[None]  # [1, n, width]
            cos, sin = self.get_submodule(f"{name}.rotary_emb")(entries, position_ids=block_starts[None],
                                                                layer_type=self.rope_layer_type)
            entries = self._rotate(entries.unsqueeze(1), cos, sin).squeeze(1)[0]
            row_cache.view(-1, row_cache.shape[-1] * row_cache.shape[-2])[entry_slots, series.entry_slice()] = (
                entries.to(row_cache.dtype))

    def _attend(self, ctx: AttentionContext, query: torch.Tensor, hidden_states: torch.Tensor,
                q_residual: torch.Tensor, position_ids: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        """Each request's attention over its window and entries: query [T, H, D] -> [T, H, D]."""
        key_cache, row_cache = ctx.kv_caches[self.cache_layer]
        width = row_cache.shape[-1] * row_cache.shape[-2]
        out = torch.empty_like(query)
        starts, lens = ctx.query_start_loc.tolist(), ctx.seq_lens.tolist()
        for request, seq_len in enumerate(lens):
            begin, finish = starts[request], starts[request + 1]
            if finish == begin:
                continue
            table = ctx.block_tables[request]
            first_position = seq_len - (finish - begin)
            self._pool_new_blocks(row_cache, table, first_position, seq_len)
            positions = torch.arange(first_position, seq_len, device=query.device)
            key_start = max(0, first_position - self.window + 1)
            keys = read_rows(key_cache, table, key_start, seq_len)
            num_entries = seq_len // self.rate
            entry_positions = torch.arange(num_entries, device=query.device) * self.rate + self.rate - 1
            entry_rows = row_cache.view(-1, width)[slots_of(table, entry_positions, row_cache.shape[1])]
            if self.layer_type == COMPRESSED_SPARSE:
                mask = self._select(entry_rows[:, self.series[1].entry_slice()], hidden_states[:, begin:finish],
                                    q_residual[:, begin:finish], position_ids[:, begin:finish], positions)
            else:
                mask = visible_entries(positions, self.rate, num_entries)
            out[begin:finish] = attend_window_and_entries(
                query[begin:finish], keys, torch.arange(key_start, seq_len, device=query.device),
                entry_rows[:, self.series[0].entry_slice()], mask, positions, self.window, sinks, self.scale)
        return out

    def _select(self, index_entries: torch.Tensor, hidden_states: torch.Tensor, q_residual: torch.Tensor,
                position_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One request's CSA selection [n, E] from its n queries' rows of the step."""
        module = self.get_submodule
        num_queries = hidden_states.shape[1]
        cos, sin = module("compressor.indexer.rotary_emb")(hidden_states, position_ids=position_ids,
                                                           layer_type=self.rope_layer_type)
        q_index = module("compressor.indexer.q_b_proj")(q_residual).view(1, num_queries, -1, self.index_head_dim)
        q_index = self._rotate(q_index.transpose(1, 2), cos, sin)[0].transpose(0, 1)  # [n, H, D]
        weights = module("compressor.indexer.scorer.weights_proj")(hidden_states[0]).float()
        return select_entries(q_index, weights * self.index_weights_scale, index_entries, positions, self.rate,
                              self.index_topk, self.index_scale)
