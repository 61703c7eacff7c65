"""A hybrid decoder layer's forward on the CPU path (Qwen3.5, Qwen3-Next and their MoE
variants), with the fused kernels, as engine/cpu/layers.py's FusedDecoderLayer runs
the Llama family's.

Such a layer is pre-norm: a mixer (a gated delta-net layer, already a RecurrentLayer,
or gated full attention), a residual add, the post-mixer norm, the MLP and another
residual add. ``FusedHybridDecoderLayer`` calls the layer's own submodules but fuses
the first residual add into the post-mixer norm (one kernel pass), and runs gated
attention as:

- one matmul over the query, gate, key and value weights packed side by side, the
  query projection's rows reordered so that the queries of every head come first,
  then the gates (transformers' q_proj interleaves them per head);
- the per-head q and k norms through the fused kernel, the rotation in place (the
  rotated part alone where the model rotates part of each head), the engine's
  attention, then the output gate ``attended * sigmoid(gate)`` and o_proj.

The decoder's last layer feeds only the final norm and the LM head, which read the
step's sampled rows. On a step that samples fewer rows than it runs (prefill), an
attention layer there writes every token's keys and values to the cache but runs
queries, attention, the output gate, o_proj and the MLP at the sampled rows alone (a
request's last token attends its whole context, as in decoding, through the attention
backend's ``attend_sampled_rows``); a gated delta-net layer there runs its mixer at
every row (its state needs them) and the MLP at the sampled rows. Other rows of the
result are zeros, which nothing reads.

A layer is replaced only if the replacement gives the layer's own output on a probe
step; anything else (gradients, float64, no engine context) runs the layer's own forward.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..attention.context import AttentionContext, AttentionOptions
from ..kernels.cpu_fused import fused_kernels_available, rotary_
from ..recurrent.state import RecurrentLayer
from ..surgery import probe_matches, replace
from .layers import LayerReplacement, replace_decoder_layers
from .linear import PackedLinear, packable_side_by_side, packed_matmul
from .norms import FUSED_DTYPES, add_norm_rows, norm_rows, same_output
from .probe import probe_cache, probe_context, probe_layer
from .protocols import (
    AttentionFunction,
    GatedAttention,
    GatedAttentionDecoder,
    HybridDecoder,
    RecurrentDecoder,
    WeightedNorm,
)

if TYPE_CHECKING:  # typing.TypeIs is Python 3.13's
    from typing_extensions import TypeIs

logger = logging.getLogger(__name__)

# Decoder layers of this shape: input_layernorm, a gated delta-net ``linear_attn`` or a
# gated ``self_attn`` (q_proj yields queries and gates), post_attention_layernorm, mlp.
HYBRID_DECODER_LAYERS = ("Qwen3_5DecoderLayer", "Qwen3_5MoeDecoderLayer", "Qwen3NextDecoderLayer")

# A packed oneDNN weight and its bias (or None), as packed_matmul takes them.
PackedRows = tuple[torch.Tensor, torch.Tensor | None]


def _rotate_(query: torch.Tensor, key: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate query [T, H, D] and key [T, Hkv, D] (contiguous; or no key) in place by
    cos, sin [T, R]: the first R of each head's D values where R < D (partial rotary)."""
    rotary_dim, head_dim = cos.shape[-1], query.shape[-1]
    if rotary_dim == head_dim:
        rotary_(query, key, cos, sin)
        return
    query_part = query[..., :rotary_dim].contiguous()
    if key is None:
        rotary_(query_part, None, cos, sin)
    else:
        key_part = key[..., :rotary_dim].contiguous()
        rotary_(query_part, key_part, cos, sin)
        key[..., :rotary_dim] = key_part
    query[..., :rotary_dim] = query_part


def _pack_rows(weight: torch.Tensor, bias: torch.Tensor | None, packed_dtype: torch.dtype,
               rows_hint: int) -> PackedRows:
    """One packed oneDNN weight (and bias) of these output rows."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(packed_dtype).contiguous(), rows_hint)
    return packed, None if bias is None else bias.detach().to(packed_dtype).contiguous()


class GatedAttentionWeights:
    """The packed weights of a gated attention's projections: queries and gates (the
    queries of every head first) and keys and values, as one matrix (``all``) or two
    (``query_gate``, ``key_value``)."""

    sizes: list[int]  # the output widths of queries, gates, keys and values
    all: PackedRows | None
    query_gate: PackedRows | None
    key_value: PackedRows | None

    def __init__(self, projections: tuple[PackedLinear, ...], num_heads: int, head_dim: int, rows_hint: int,
                 split: bool) -> None:
        q_proj, k_proj, v_proj = projections  # packable_side_by_side: one input size and dtype, all biased or none
        hidden, packed_dtype = q_proj.in_features, q_proj.packed_weight.dtype

        def queries_then_gates(tensor: torch.Tensor) -> torch.Tensor:  # [H * 2D, ...] per head (q, gate)
            per_head = tensor.detach().reshape(num_heads, 2, head_dim, -1)
            return torch.cat([per_head[:, 0], per_head[:, 1]]).reshape(2 * num_heads * head_dim, -1)

        qg_weight = queries_then_gates(q_proj.weight).view(-1, hidden)
        kv_weight = torch.cat([k_proj.weight.detach(), v_proj.weight.detach()])
        q_bias, k_bias, v_bias = q_proj.bias, k_proj.bias, v_proj.bias
        qg_bias = kv_bias = None
        if q_bias is not None and k_bias is not None and v_bias is not None:
            qg_bias = queries_then_gates(q_bias).view(-1)
            kv_bias = torch.cat([k_bias.detach(), v_bias.detach()])
        self.sizes = [num_heads * head_dim, num_heads * head_dim, k_proj.out_features, v_proj.out_features]
        self.all = self.query_gate = self.key_value = None
        if split:  # the last layer projects keys and values at every row, queries at fewer
            self.query_gate = _pack_rows(qg_weight, qg_bias, packed_dtype, rows_hint)
            self.key_value = _pack_rows(kv_weight, kv_bias, packed_dtype, rows_hint)
        else:
            all_bias = None if qg_bias is None or kv_bias is None else torch.cat([qg_bias, kv_bias])
            self.all = _pack_rows(torch.cat([qg_weight, kv_weight]), all_bias, packed_dtype, rows_hint)


class FusedHybridDecoderLayer(LayerReplacement):
    """A hybrid decoder layer's forward with the fused kernels (see the module
    docstring). ``layer`` is the original, whose submodules it calls, whose forward
    runs whatever this one does not take, and whose other attributes it answers for.
    Its mixer is read through the Protocol of its kind (gated attention where
    ``attend`` is set, else a recurrent layer), as ``_fits`` checked when it was built."""

    layer: HybridDecoder  # registered as a submodule; typed by what is read of it
    attend: AttentionFunction | None  # None: a recurrent mixer
    weights: GatedAttentionWeights | None

    def __init__(self, layer: HybridDecoder, attend: AttentionFunction | None, is_last: bool,
                 rows_hint: int) -> None:
        super().__init__()
        self.layer = layer
        self.attend = attend  # the engine's attention function, as registered with transformers
        self.is_last = is_last
        self.num_heads = 0  # 0: a recurrent mixer
        self.weights = None
        if _attends(layer):
            attention = layer.self_attn
            self.num_heads = attention.config.num_attention_heads
            projections = (attention.q_proj, attention.k_proj, attention.v_proj)
            if packable_side_by_side(projections):
                self.weights = GatedAttentionWeights(projections, self.num_heads, attention.head_dim, rows_hint,
                                                     split=is_last)

    def forward(self, hidden_states: torch.Tensor, *args: Any,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                shardline_ctx: AttentionContext | None = None, **kwargs: Any) -> torch.Tensor:
        # hidden_states: [1, T, hidden] -> [1, T, hidden]
        layer, attend = self.layer, self.attend
        if (args or shardline_ctx is None or torch.is_grad_enabled()
                or (attend is not None and position_embeddings is None)
                or hidden_states.dtype != cast(WeightedNorm, layer.post_attention_layernorm).weight.dtype):
            return layer(hidden_states, *args, position_embeddings=position_embeddings,
                         shardline_ctx=shardline_ctx, **kwargs)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        rows = shardline_ctx.sampled_rows if self.is_last else None
        if rows is not None and rows.numel() >= x.shape[0]:
            rows = None
        normed = norm_rows(layer.input_layernorm, x)
        if attend is not None and position_embeddings is not None:  # (an attention layer has both, checked above)
            mixed = self._attention(attend, normed, position_embeddings, shardline_ctx, rows)
        else:  # a recurrent mixer
            mixer = cast(RecurrentDecoder, layer).linear_attn
            mixed = mixer(normed[None], shardline_ctx=shardline_ctx, shardline_state=kwargs.get("shardline_state"))[0]
            mixed = mixed if rows is None else mixed.index_select(0, rows)
        if rows is not None and rows.numel() == 0:  # a step of partial prefill chunks only: nothing is read
            return x.new_zeros(hidden_states.shape)
        # The residual stream: x + the mixer's output, summed into the mixer's fresh output.
        residual = mixed
        normed = add_norm_rows(layer.post_attention_layernorm, residual, x if rows is None else x.index_select(0, rows))
        mlp_out = layer.mlp(normed[None])  # [1, T, hidden], as the decoder calls it (MoE blocks read 3 dimensions)
        mlp_out = mlp_out[0] if isinstance(mlp_out, tuple) else mlp_out
        out = residual.add_(mlp_out.view(residual.shape))
        if rows is None:
            return out.view(hidden_states.shape)
        return x.new_zeros(x.shape).index_copy_(0, rows, out).view(hidden_states.shape)

    def _attention(self, attend: AttentionFunction, x: torch.Tensor,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext,
                   rows: torch.Tensor | None) -> torch.Tensor:
        """Gated attention's output [T or R, hidden] of normed x [T, hidden], at ``rows``
        alone where given (keys and values of every row still go to the cache)."""
        attention = cast(GatedAttentionDecoder, self.layer).self_attn
        tokens, head_dim = x.shape[0], attention.head_dim
        cos, sin = (table.reshape(tokens, -1).contiguous() for table in position_embeddings)
        if rows is None:
            query, gate, key, value = self._project(attention, x)
        else:
            key, value = self._project_key_value(attention, x)
        key = norm_rows(attention.k_norm, key.reshape(-1, head_dim)).view(tokens, -1, head_dim)
        value = value.view(tokens, -1, head_dim)
        if rows is None:
            query = norm_rows(attention.q_norm, query.reshape(-1, head_dim)).view(tokens, -1, head_dim)
            _rotate_(query, key, cos, sin)
            attended, _ = attend(
                attention, query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
                None, dropout=0.0, scaling=attention.scaling, sliding_window=None, shardline_ctx=ctx)
        else:
            _rotate_(key, None, cos, sin)
            if rows.numel():
                query, gate = self._project_query_gate(attention, x.index_select(0, rows))
                query = norm_rows(attention.q_norm, query.reshape(-1, head_dim)).view(rows.numel(), -1, head_dim)
                _rotate_(query, None, cos.index_select(0, rows), sin.index_select(0, rows))
            else:  # a step of partial prefill chunks only: keys and values are cached, nothing is read
                query = gate = x.new_empty((0, self.num_heads, head_dim))
            # Every row's keys and values go to the cache; the sampled rows attend.
            backend = ctx.backend
            assert backend is not None, "a step that samples some rows has its backend (model runner)"
            attended = backend.attend_sampled_rows(ctx, attention.layer_idx, query, key, value,
                                                   AttentionOptions(attention.scaling))
            if rows.numel() == 0:
                return x.new_zeros((0, x.shape[1]))
        rows_out = query.shape[0]
        gated = torch.sigmoid(gate).reshape(rows_out, -1).mul_(attended.reshape(rows_out, -1))
        return attention.o_proj(gated)

    # Projections: queries [T, H, D] and gates [T, H * D] or [T, H, D] (views of a matmul's
    # output, D contiguous), keys and values [T, Hkv * D]. The packed weights are one
    # matrix where the layer always projects every row (``all``), two for the last layer.
    def _project(self, attention: GatedAttention, x: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        weights = self.weights
        if weights is not None and weights.all is not None:
            query, gate, key, value = packed_matmul(x, *weights.all).split(weights.sizes, dim=-1)
            return query, gate, key, value
        return (*self._project_query_gate(attention, x), *self._project_key_value(attention, x))

    def _project_query_gate(self, attention: GatedAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = self.weights
        if weights is not None and weights.query_gate is not None:
            query, gate = packed_matmul(x, *weights.query_gate).split(weights.sizes[:2], dim=-1)
            return query, gate
        per_head = attention.q_proj(x).view(x.shape[0], self.num_heads, 2, attention.head_dim)
        return per_head[:, :, 0], per_head[:, :, 1]

    def _project_key_value(self, attention: GatedAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = self.weights
        if weights is not None and weights.key_value is not None:
            key, value = packed_matmul(x, *weights.key_value).split(weights.sizes[2:], dim=-1)
            return key, value
        return attention.k_proj(x), attention.v_proj(x)


def _fits(layer: object) -> TypeIs[HybridDecoder]:
    """Whether the layer has the shape FusedHybridDecoderLayer runs: a hybrid decoder
    layer whose mixer is a RecurrentLayer or gated attention (``_is_gated_attention``)."""
    if type(layer).__name__ not in HYBRID_DECODER_LAYERS:
        return False
    if not all(hasattr(layer, name) for name in ("input_layernorm", "post_attention_layernorm", "mlp")):
        return False
    attention, mixer = getattr(layer, "self_attn", None), getattr(layer, "linear_attn", None)
    if mixer is not None:
        return attention is None and isinstance(mixer, RecurrentLayer)
    return attention is not None and _is_gated_attention(attention)


def _is_gated_attention(attention: object) -> TypeIs[GatedAttention]:
    """Whether ``attention`` is full attention without a sliding window whose q_proj
    gives each head's queries and gates, with per-head q and k norms."""
    config, head_dim = getattr(attention, "config", None), getattr(attention, "head_dim", None)
    if config is None or head_dim is None or not all(hasattr(attention, name) for name in (
            "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "scaling", "layer_idx")):
        return False
    if getattr(attention, "sliding_window", None) or getattr(config, "sliding_window", None):
        return False
    q_proj, k_proj = getattr(attention, "q_proj", None), getattr(attention, "k_proj", None)
    return (getattr(q_proj, "out_features", None) == 2 * config.num_attention_heads * head_dim
            and getattr(k_proj, "out_features", None) == config.num_key_value_heads * head_dim)


def _attends(layer: HybridDecoder) -> TypeIs[GatedAttentionDecoder]:
    """Whether a layer that ``_fits`` has gated attention for its mixer (else a recurrent layer)."""
    return getattr(layer, "self_attn", None) is not None


def _probe_layer(layer: nn.Module, rotary_emb: nn.Module, hidden_size: int, dtype: torch.dtype,
                 layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The layer's output for the probe request (cpu/probe.py; a recurrent mixer runs
    from zero state, keeping nothing)."""
    cache = probe_cache(max(num_kv_heads, 1), head_dim, dtype)
    ctx = probe_context([cache] * (layer_idx + 1), max(num_heads, 1))
    return probe_layer(layer, rotary_emb, hidden_size, dtype, ctx)


def fuse_hybrid_decoder_layers(model: nn.Module, rows_hint: int) -> int:
    """Replace every hybrid decoder layer (HYBRID_DECODER_LAYERS) by a
    FusedHybridDecoderLayer where that gives the layer's own output on a probe step;
    returns how many were replaced. ``rows_hint``: the row count oneDNN tunes the
    packed attention weights for (engine/cpu/linear.py)."""
    return replace_decoder_layers(model, lambda layer, position, rotary_emb, is_last: _fused_layer(
        layer, position, rotary_emb, is_last, rows_hint))


def _fused_layer(layer: nn.Module, position: int, rotary_emb: nn.Module, is_last: bool,
                 rows_hint: int) -> FusedHybridDecoderLayer | None:
    """The layer's replacement, or None where it does not fit or would differ."""
    if not _fits(layer):
        return None
    weight = getattr(layer.post_attention_layernorm, "weight", None)
    if (not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or weight.dtype not in FUSED_DTYPES
            or not fused_kernels_available(weight.dtype)):
        return None
    attend: AttentionFunction | None = None
    if _attends(layer):
        attention = layer.self_attn
        attend = ALL_ATTENTION_FUNCTIONS.get(attention.config._attn_implementation)
        if attend is None:
            return None
        shape = (attention.layer_idx, attention.config.num_attention_heads, attention.config.num_key_value_heads,
                 attention.head_dim)
    else:
        shape = (position, 0, 0, 1)
    try:
        with torch.no_grad():
            fused = FusedHybridDecoderLayer(layer, attend, is_last, rows_hint)
    except Exception:  # a layer the fused forward does not fit
        logger.debug("building the fused forward of %s failed", type(layer).__name__, exc_info=True)
        fused = None
    if fused is None or not probe_matches(layer, fused, lambda module: _probe_layer(
            module, rotary_emb, weight.shape[0], weight.dtype, *shape), same_output):
        logger.info("%s does not match the fused hybrid forward; it keeps its own", type(layer).__name__)
        return None
    if fused.weights is not None:  # their own packed copies are no longer read
        for name in ("q_proj", "k_proj", "v_proj"):
            projection = layer.get_submodule(f"self_attn.{name}")
            if isinstance(projection, PackedLinear):
                replace(layer, f"self_attn.{name}", projection.unpacked())
    return fused
