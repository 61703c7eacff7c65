"""inkling2's and inkling2_loop's attention layers on the paged cache.

They keep inkling's cache layout (engine/model/adapters/inkling.py): each decoder layer's
four short convolutions (raw keys, raw values, attention output, MLP output) keep their
inputs per token in a cache layer of their own, a sliding window of ``conv_kernel_size``
tokens after the attention layers, so chunked prefill, prefix hits and preemption need
no state. What differs:

- the convolutions scale their output, (conv + input) / sqrt(K + 1);
- the full layers' key and value convolutions are dynamic: token t's taps are the
  static ones plus taps projected from that token's own key (value) layer input, one
  set per key-value head (Inkling2DynamicShortConvolution). Only token t's input makes
  its taps, so the cached inputs of the tokens before it are all it needs; their sum is
  scaled by 1 / sqrt(2K + 1);
- each attention adds one sink logit per head and query (a linear map of the query's
  hidden state, with a zero value), gates its output by a sigmoid of its input, and
  takes queries and the relative-bias states through the model's own L2 clips (the
  full layers' logarithmic scaling inside them, by position);
- the layers' inputs come from attention over depth (Inkling2BlockAttentionResidual:
  per token, learned queries over the earlier blocks' outputs at that token), which
  needs nothing cached; it runs the model's own eager attention (``EagerDepthAttention``)
  since the model's attention entry point is the paged one;
- inkling2_loop runs its looped layers several times per token; each pass after the
  first names its cache layers by ``cache_offset`` (after the model's layers, as
  kv_cache_spec.repeated_pass_layers lists them), for its keys and values and for its
  convolutions' inputs alike.

The attention runs here in torch, per request, over the keys it sees, as transformers'
eager attention computes it (scores, bias, mask, then the softmax in float32 with the
sink).
"""

from __future__ import annotations

import copy
import inspect
import math

import torch
import transformers
from torch import nn

from ...attention.context import AttentionContext
from ...attention.latent_window import window_start
from .base import StepScope, _Replacement, layer_attribute
from .inkling import PagedShortConv, _slots, head_layout, layer_context

INKLING2_TYPES = ("inkling2_text", "inkling2_loop_text")


def repeated_loop_layers(text_config: transformers.PretrainedConfig) -> list[int]:
    """inkling2_loop's looped layers, once per pass after the first, in the order of the
    cache layers those passes attend after the model's (``cache_offset``); [] otherwise."""
    if text_config.model_type != "inkling2_loop_text":
        return []
    start, end = int(text_config.loop_layer_index_start), int(text_config.loop_layer_index_end)
    return list(range(start, end)) * (int(text_config.loop_num_passes) - 1)


class ScaledShortConv(PagedShortConv):
    """Inkling2ShortConvolution: inkling's cached short convolution, its output scaled
    by 1 / sqrt(K + 1), the call's cache layer offset by ``cache_offset``."""

    def forward(self, hidden_states: torch.Tensor, dynamic_input: torch.Tensor | None = None, cache: object = None,
                conv_mask: torch.Tensor | None = None, cache_offset: int = 0, **kwargs):
        ctx = self._scope.ctx
        if ctx is None:
            return self.original(hidden_states, dynamic_input, cache=cache, conv_mask=conv_mask,
                                 cache_offset=cache_offset, **kwargs)
        rows = hidden_states[0].float()  # [T, C]
        weight = self.get_parameter("conv1d.weight")  # [C, 1, K] float32
        out = torch.empty_like(rows)
        for first, end, history in self.windows(ctx, rows, cache_offset):
            stream = torch.cat([history, rows[first:end]]).transpose(0, 1)[None]  # [1, C, L]
            conv = torch.nn.functional.conv1d(stream, weight, None, padding=self.kernel - 1, groups=self.channels)
            out[first:end] = conv[0, :, :stream.shape[-1]].transpose(0, 1)[-(end - first):]
        return ((out + rows) / math.sqrt(self.kernel + 1)).to(hidden_states.dtype)[None]


class DynamicShortConv(PagedShortConv):
    """Inkling2DynamicShortConvolution (see the module docstring): each token's taps
    [H, 1, K] (static plus projected from its ``dynamic_input``) weight its own window,
    the K - 1 cached inputs before it and its own."""

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self.num_heads = layer_attribute(original, "num_heads", int)

    @staticmethod
    def input_width(original: nn.Module) -> int:
        return original.get_parameter("static_weight").shape[1]

    def forward(self, hidden_states: torch.Tensor, dynamic_input: torch.Tensor, cache: object = None,
                conv_mask: torch.Tensor | None = None, cache_offset: int = 0, **kwargs):
        ctx = self._scope.ctx
        if ctx is None:
            return self.original(hidden_states, dynamic_input, cache=cache, conv_mask=conv_mask,
                                 cache_offset=cache_offset, **kwargs)
        kernel, heads = self.kernel, self.num_heads
        dynamic = self.get_submodule("weight_proj")(dynamic_input[0]).float().view(-1, heads, 1, kernel)
        static = self.get_parameter("static_weight").float().T.view(heads, -1, kernel)
        rows = hidden_states[0].float()  # [T, C]
        out = torch.empty_like(rows)
        for first, end, history in self.windows(ctx, rows, cache_offset):
            count = end - first
            context = torch.cat([rows.new_zeros(kernel - 1 - history.shape[0], self.channels), history,
                                 rows[first:end]]).transpose(0, 1)  # [C, count + K - 1]
            # window[t, c, lag]: channel c of the token lag steps before token t
            window = context.unfold(-1, kernel, 1).flip(-1).transpose(0, 1).reshape(count, heads, -1, kernel)
            out[first:end] = (window * (static + dynamic[first:end])).sum(-1).reshape(count, self.channels)
        return ((out + rows) / math.sqrt(2 * kernel + 1)).to(hidden_states.dtype)[None]


class EagerDepthAttention(_Replacement):
    """Inkling2BlockAttentionResidual (and the loop's message residual): attention over
    a token's earlier block outputs, nothing cached. The model's attention entry point
    is the paged one, so the module gets a copy of its config naming transformers'
    eager attention and runs its own forward, inside a step and out."""

    def __init__(self, original: nn.Module, layer_idx: int | None, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        config = copy.copy(layer_attribute(original, "config", transformers.PretrainedConfig))
        config._attn_implementation = "eager"
        vars(original)["config"] = config  # a plain attribute (nn.Module's setattr is typed for tensors)

    def forward(self, *args, **kwargs):
        return self.original(*args, **kwargs)


class Inkling2Attention(_Replacement):
    """Replaces one Inkling2SlidingAttention or Inkling2FullAttention (and the loop
    model's): see the module docstring."""

    layer_idx: int

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_attribute(original, "layer_idx", int), scope)
        self._signature = inspect.signature(original.forward)
        (self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.rel_extent,
         self.sliding_window) = head_layout(original)

    def forward(self, *args, **kwargs):
        ctx = self._scope.ctx
        if ctx is None:
            return self.original(*args, **kwargs)
        call = self._signature.bind(*args, **kwargs)
        call.apply_defaults()
        arguments = call.arguments
        x = arguments["hidden_states"]  # [1, T, hidden]
        assert x.shape[0] == 1, "the engine runs one packed sequence"
        key_x, value_x = arguments["key_hidden_states"], arguments["value_hidden_states"]
        key_x, value_x = x if key_x is None else key_x, x if value_x is None else value_x
        offset = int(arguments["cache_offset"])
        positions = arguments["kwargs"]["position_ids"]
        module = self.get_submodule
        query = module("q_proj")(x, positions)[0].transpose(0, 1)  # [T, H, D]
        key = module("k_proj")(key_x, cache_offset=offset)[0].transpose(0, 1)  # [T, Hkv, D]
        value = module("v_proj")(value_x, cache_offset=offset)[0].transpose(0, 1)
        bias_module = module("relative_position_bias")
        relative = bias_module.get_submodule("linear")(x).view(*x.shape[:-1], self.num_heads, -1)
        relative = bias_module.get_submodule("norm")(relative, positions)
        rel_logits = (relative @ bias_module.get_parameter("proj"))[0]  # [T, H, rel_extent]
        sinks = module("sink_proj")(x)[0]  # [T, H]
        layer = self.layer_idx + offset
        ctx = layer_context(ctx, layer)
        key_cache, value_cache = ctx.kv_caches[layer]
        key_cache.view(-1, key_cache.shape[-1]).index_copy_(0, ctx.slot_mapping, key.flatten(1).to(key_cache.dtype))
        value_cache.view(-1, value_cache.shape[-1]).index_copy_(
            0, ctx.slot_mapping, value.flatten(1).to(value_cache.dtype))
        out = query.new_empty(query.shape)
        starts, lens = ctx.query_start_loc.tolist(), ctx.seq_lens.tolist()
        for request, seq_len in enumerate(lens):
            first, end = starts[request], starts[request + 1]
            if end > first:
                out[first:end] = self._attend(ctx, layer, request, seq_len, query[first:end], rel_logits[first:end],
                                              sinks[first:end])
        return module("o_proj")(out.reshape(1, x.shape[1], -1), x), None

    def _attend(self, ctx: AttentionContext, layer: int, request: int, seq_len: int, query: torch.Tensor,
                rel_logits: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        """One request's n queries [n, H, D] over the keys they see in cache layer
        ``layer``; rel_logits [n, H, E]; sinks [n, H]. Returns [n, H, D]."""
        num_queries = query.shape[0]
        start = window_start(seq_len, num_queries, self.sliding_window)
        slots = _slots(ctx, request, start, seq_len)
        key_cache, value_cache = ctx.kv_caches[layer]
        keys = key_cache.view(-1, key_cache.shape[-1])[slots].view(-1, self.num_kv_heads, self.head_dim)
        values = value_cache.view(-1, value_cache.shape[-1])[slots].view(-1, self.num_kv_heads, self.head_dim)
        group = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1).to(query.dtype).permute(1, 2, 0)  # [H, D, S']
        values = values.repeat_interleave(group, dim=1).to(query.dtype).transpose(0, 1)  # [H, S', D]
        query_pos = torch.arange(seq_len - num_queries, seq_len, device=query.device)
        distance = query_pos[:, None] - torch.arange(start, seq_len, device=query.device)[None, :]  # [n, S']
        index = distance.clamp(0, self.rel_extent - 1)[:, None, :].expand(-1, self.num_heads, -1)
        bias = rel_logits.gather(-1, index).masked_fill(
            ((distance < 0) | (distance >= self.rel_extent))[:, None, :], 0.0).transpose(0, 1)  # [H, n, S']
        hidden = distance < 0
        if self.sliding_window is not None:
            hidden = hidden | (distance >= self.sliding_window)
        scores = torch.matmul(query.transpose(0, 1), keys) * self.scale + bias
        scores = scores + torch.zeros_like(distance, dtype=scores.dtype).masked_fill(
            hidden, torch.finfo(scores.dtype).min)
        with_sink = torch.cat([scores, sinks.transpose(0, 1)[:, :, None].to(scores.dtype)], dim=-1).float()
        weights = with_sink.softmax(dim=-1)[..., :-1].to(query.dtype)
        return torch.matmul(weights, values).transpose(0, 1)
