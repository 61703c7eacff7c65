"""inkling's attention layers on the paged cache: short convolutions whose inputs are
cached per token, and a relative position bias that each query computes from its own
hidden state.

An inkling layer ("hybrid": full attention, "hybrid_sliding": a sliding window of
``sliding_window_size`` keys) convolves four streams over the last ``conv_kernel_size``
tokens, each in float32 with a residual: its raw keys and values before they are
normed and attended (k_sconv, v_sconv), the attention's output and the MLP's output
(the decoder layer's attn_sconv and mlp_sconv). A token's convolution reads the inputs
of the tokens before it, so the engine keeps, per token, those four inputs in a cache
layer of their own (``PagedShortConv``): after the model's L layers (keys and values,
one row each per token) come L more, layer i's at L + i, its key row [raw key | raw
value], its value row [attention output | MLP output]; they are sliding-window layers
of ``conv_kernel_size`` tokens, so their windowed block group hands back the blocks no
later convolution reads. They come back with cached blocks on a prefix hit, are
recomputed with the rest after a preemption, and a prompt's chunk reads its
predecessors' from the cache; no recurrent state is kept. (Inputs of the model's dtype
are exact in its cache: the float32 convolution reads them widened.)

The bias (``InklingAttention``): r_proj(x) gives each query d_rel numbers per head,
mixed by the learned bank ``rel_logits_proj.proj`` [d_rel, rel_extent] into one bias
per backward distance 0 .. rel_extent - 1 (zero beyond), added to the scaled scores;
full layers scale query and bias by 1 + alpha * log(max(1, (p + 1) / n_floor)) at
position p where ``log_scaling_n_floor`` is set. Queries and keys are RMS-normed per
head (no rotation) and scaled by 1 / head_dim. The attention runs here in torch, per
request, over the keys it sees (a window's from its first key on).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import torch
import transformers
from torch import nn
from torch.nn import functional as F

from ...attention.context import AttentionContext
from ...attention.latent_window import window_start
from .base import StepScope, _Replacement, layer_attribute, layer_scale

# inkling's cache layout: its own, and inkling2's (engine/model/adapters/inkling2.py).
INKLING_TYPES = ("inkling_text", "inkling2_text", "inkling2_loop_text")


def _layer_sizes(text_config: transformers.PretrainedConfig, layer_type: str) -> tuple[int, int]:
    """(key-value heads, head size) of an inkling layer of ``layer_type``."""
    if layer_type == "hybrid_sliding":
        return text_config.swa_num_key_value_heads, text_config.swa_head_dim
    return text_config.num_key_value_heads, text_config.head_dim


def inkling_kv_width(text_config: transformers.PretrainedConfig, layer_type: str) -> int:
    """Numbers per token of an inkling layer's keys (and of its values): all its heads'."""
    kv_heads, head_dim = _layer_sizes(text_config, layer_type)
    return kv_heads * head_dim


def inkling_conv_widths(text_config: transformers.PretrainedConfig, layer_type: str) -> tuple[int, int]:
    """(key row, value row) widths of an inkling layer's convolution-input cache layer:
    raw keys and values, then the attention and MLP outputs (the module docstring)."""
    return 2 * inkling_kv_width(text_config, layer_type), 2 * text_config.hidden_size


def layer_context(ctx: AttentionContext, layer_idx: int) -> AttentionContext:
    """The context of the layer's block table: its windowed group's, or the step's own."""
    group = ctx.layer_groups[layer_idx] if ctx.layer_groups else 0
    return ctx if group == 0 else ctx.group_contexts[group - 1]


def _slots(ctx: AttentionContext, request: int, first: int, end: int) -> torch.Tensor:
    """Cache slots of positions first .. end - 1 of ``request``."""
    block_size = ctx.kv_caches[0][0].shape[1]
    positions = torch.arange(first, end, device=ctx.block_tables.device)
    blocks = ctx.block_tables[request].long()[positions // block_size]
    return blocks * block_size + positions % block_size


class PagedShortConv(_Replacement):
    """One of an inkling layer's short convolutions (InklingShortConvolution): writes its
    inputs into the layer's cache rows and convolves each request's new tokens with the
    inputs of the ``conv_kernel_size - 1`` tokens before them, read back from there."""

    layer_idx: int

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_attribute(original, "layer_idx", int), scope)
        self.kernel = layer_attribute(original, "conv_kernel_size", int)
        conv_idx = layer_attribute(original, "conv_idx", int)
        self.channels = self.input_width(original)
        # Raw keys and values in the key row, attention and MLP outputs in the value row.
        self._row, self._offset = conv_idx // 2, conv_idx % 2 * self.channels

    @staticmethod
    def input_width(original: nn.Module) -> int:
        """Channels the convolution convolves (its depthwise conv1d's)."""
        return layer_attribute(original.get_submodule("conv1d"), "in_channels", int)

    def forward(self, hidden_states: torch.Tensor, cache: object = None, conv_mask: torch.Tensor | None = None,
                **kwargs):
        ctx = self._scope.ctx
        if ctx is None:
            return self.original(hidden_states, cache=cache, conv_mask=conv_mask, **kwargs)
        rows = hidden_states[0].float()  # [T, C]
        weight = self.get_parameter("conv1d.weight")  # [C, 1, K] float32
        out = torch.empty_like(rows)
        for first, end, history in self.windows(ctx, rows, 0):
            stream = torch.cat([history, rows[first:end]]).transpose(0, 1)[None]  # [1, C, L]
            conv = F.conv1d(stream, weight, None, padding=self.kernel - 1, groups=self.channels)
            out[first:end] = conv[0, :, :stream.shape[-1]].transpose(0, 1)[-(end - first):]
        return (out + rows).to(hidden_states.dtype)[None]

    def windows(self, ctx: AttentionContext, rows: torch.Tensor,
                cache_offset: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Write the step's inputs ``rows`` [T, C] into this convolution's cache rows (those
        of the call's layer, ``layer_idx + cache_offset``), then for each request with new
        tokens: their rows first .. end - 1 and the inputs of the up to
        ``conv_kernel_size - 1`` tokens before them, read back from the cache ([h, C], in
        the rows' dtype widened to float32; fewer at a prompt's start)."""
        cache_layer = conv_cache_layer(ctx, self.layer_idx + cache_offset)
        ctx = layer_context(ctx, cache_layer)
        cache = ctx.kv_caches[cache_layer][self._row]
        flat = cache.view(-1, cache.shape[-1])
        offset = self._offset
        flat[ctx.slot_mapping, offset:offset + self.channels] = rows.to(flat.dtype)
        starts, lens = ctx.query_start_loc.tolist(), ctx.seq_lens.tolist()
        for request, seq_len in enumerate(lens):
            first, end = starts[request], starts[request + 1]
            if end == first:
                continue
            position = seq_len - (end - first)
            history_start = max(0, position - self.kernel + 1)
            history = flat[_slots(ctx, request, history_start, position), offset:offset + self.channels].float()
            yield first, end, history


def conv_cache_layer(ctx: AttentionContext, layer_idx: int) -> int:
    """The cache layer of decoder layer ``layer_idx``'s convolution inputs: after the
    model's layers, as many again (KVCacheSpec.from_hf_config)."""
    return len(ctx.kv_caches) // 2 + layer_idx


def head_layout(original: nn.Module) -> tuple[int, int, int, float, int, int | None]:
    """An Inkling or Inkling2 attention's (heads, key/value heads, head size, scale,
    relative-bias extent, sliding window or None), read from the original module."""
    window = getattr(original, "sliding_window", None)
    return (layer_attribute(original, "num_heads", int), layer_attribute(original, "num_key_value_heads", int),
            layer_attribute(original, "head_dim", int), layer_scale(original, "scaling"),
            layer_attribute(original, "rel_extent", int),
            None if window is None else int(layer_scale(original, "sliding_window")))


class InklingAttention(_Replacement):
    """Replaces one InklingAttention module (see the module docstring)."""

    layer_idx: int

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self._signature = inspect.signature(original.forward)
        (self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.rel_extent,
         self.sliding_window) = head_layout(original)
        config = layer_attribute(original, "config", transformers.PretrainedConfig)
        floor = config.log_scaling_n_floor if self.sliding_window is None else None
        self.log_scaling = None if floor is None else (float(floor), float(config.log_scaling_alpha))

    def forward(self, *args, **kwargs):
        ctx = self._scope.ctx
        if ctx is None:
            return self.original(*args, **kwargs)
        ctx = layer_context(ctx, self.layer_idx)
        x = self._signature.bind(*args, **kwargs).arguments["hidden_states"]
        assert x.shape[0] == 1, "the engine runs one packed sequence"
        module = self.get_submodule
        num_tokens = x.shape[1]
        query = module("q_norm")(module("q_proj")(x).view(num_tokens, self.num_heads, self.head_dim))
        key = module("k_sconv")(module("k_proj")(x))[0].view(num_tokens, self.num_kv_heads, self.head_dim)
        value = module("v_sconv")(module("v_proj")(x))[0]
        key = module("k_norm")(key)
        relative = module("r_proj")(x)[0].view(num_tokens, self.num_heads, -1)
        rel_logits = relative @ self.get_parameter("rel_logits_proj.proj")  # [T, H, rel_extent]
        key_cache, value_cache = ctx.kv_caches[self.layer_idx]
        key_cache.view(-1, key_cache.shape[-1]).index_copy_(0, ctx.slot_mapping, key.flatten(1).to(key_cache.dtype))
        value_cache.view(-1, value_cache.shape[-1]).index_copy_(0, ctx.slot_mapping, value.to(value_cache.dtype))
        out = query.new_empty(num_tokens, self.num_heads, self.head_dim)
        starts, lens = ctx.query_start_loc.tolist(), ctx.seq_lens.tolist()
        for request, seq_len in enumerate(lens):
            first, end = starts[request], starts[request + 1]
            if end > first:
                out[first:end] = self._attend(ctx, request, seq_len, query[first:end], rel_logits[first:end])
        return module("o_proj")(out.reshape(1, num_tokens, -1)), None

    def _attend(self, ctx: AttentionContext, request: int, seq_len: int, query: torch.Tensor,
                rel_logits: torch.Tensor) -> torch.Tensor:
        """One request's n queries [n, H, D] over the keys they see; rel_logits [n, H, E]."""
        num_queries = query.shape[0]
        start = window_start(seq_len, num_queries, self.sliding_window)
        slots = _slots(ctx, request, start, seq_len)
        key_cache, value_cache = ctx.kv_caches[self.layer_idx]
        keys = key_cache.view(-1, key_cache.shape[-1])[slots].view(-1, self.num_kv_heads, self.head_dim)
        values = value_cache.view(-1, value_cache.shape[-1])[slots].view(-1, self.num_kv_heads, self.head_dim)
        group = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(group, dim=1).to(query.dtype), values.repeat_interleave(
            group, dim=1).to(query.dtype)
        query_pos = torch.arange(seq_len - num_queries, seq_len, device=query.device)
        distance = query_pos[:, None] - torch.arange(start, seq_len, device=query.device)[None, :]  # [n, S']
        index = distance.clamp(0, self.rel_extent - 1)[:, None, :].expand(-1, self.num_heads, -1)
        bias = rel_logits.gather(-1, index).masked_fill(
            ((distance < 0) | (distance >= self.rel_extent))[:, None, :], 0.0)  # [n, H, S']
        if self.log_scaling is not None:
            floor, alpha = self.log_scaling
            tau = 1.0 + alpha * torch.log(((query_pos + 1).float() / floor).clamp(min=1.0))
            query = (query.float() * tau[:, None, None]).to(query.dtype)
            bias = (bias.float() * tau[:, None, None]).to(bias.dtype)
        scores = torch.einsum("nhd,shd->hns", query, keys) * self.scale + bias.transpose(0, 1)
        hidden = distance < 0
        if self.sliding_window is not None:
            hidden = hidden | (distance >= self.sliding_window)
        scores = scores + torch.zeros_like(distance, dtype=scores.dtype).masked_fill(
            hidden, torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.einsum("hns,shd->nhd", weights, values)
