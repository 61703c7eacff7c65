"""Leaner modules for a decoder's layers on the CPU path, with fused elementwise kernels.

On CPU, the ops between a layer's matmuls cost more than their arithmetic: each torch
op is a dispatch and a fresh temporary, and transformers' RMSNorm runs seven of them,
rotary embeddings ten. This module replaces modules by ones that run
kernels/cpu_fused.c instead, one pass each (the norms alone: cpu/norms.py):

- ``fuse_decoder_layers``: decoder layers of the Llama family (Llama, Mistral, Qwen2,
  Qwen3) become FusedDecoderLayers, whose forward calls the layer's own submodules (packed linears,
  norms, LoRA wrappers, the engine's attention) but fuses the residual add into the
  next norm and rotates q and k in place, without transformers' per-call plumbing.
  Query, key and value projections run as one matmul over their weights packed side
  by side (unless LoRA wraps them; quantized ones as one stacked call,
  engine/quantization/stacked.py): a decode step's three small matmuls each read
  their weights cold from memory, after attention has streamed the KV cache through
  the caches, so one matmul reading all three is cheaper than three.
  A layer is replaced only if the replacement gives the layer's own output on a probe
  step; anything else (training, float64, no engine attention context) goes to the
  layer's own forward.
- A decoder whose every layer was replaced becomes a FusedDecoder (cpu/fused_decoder.py):
  the same parts in the same order without transformers' per-call plumbing.
- The last of those layers feeds only the final norm and the LM head, which read the
  rows the step samples. On a step that samples fewer rows than it runs (prefill
  chunks), it writes every token's keys and values to the cache but runs queries,
  attention, o_proj and the MLP at the sampled rows alone (the model runner marks
  them; not with prompt logprobs or LoRA). On the benchmark's 8-layer model that is
  about an eighth of a prefill step's work.

float32 and bfloat16 only: float64 keeps the exact torch path, which the tests
compare with transformers token for token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..attention.context import AttentionContext, AttentionOptions, attend_in_context, paged_attention_forward
from ..kernels.cpu_fused import add_, fused_kernels_available, rotary_
from ..quantization.linear import QuantizedLinear
from ..quantization.stacked import stacked_projection
from ..surgery import probe_matches, replace
from .fused_decoder import fuse_decoders
from .linear import PackedLinear, PackedWeight, pack_side_by_side, packable_side_by_side, packed_matmul
from .norms import FUSED_DTYPES, add_norm_rows, norm_heads, norm_rows, same_output
from .probe import probe_cache, probe_context, probe_layer
from .protocols import AttentionFunction, HeadNormedAttention, LlamaAttention, LlamaDecoder

if TYPE_CHECKING:  # typing.TypeIs is Python 3.13's
    from typing_extensions import TypeIs

logger = logging.getLogger(__name__)

# Decoder-layer classes whose forward is the Llama pattern (pre-norm attention and
# MLP, residual adds), mapped to where their attention reads its sliding window.
LAYER_WINDOWS = {
    "LlamaDecoderLayer": lambda attention: None,
    "MistralDecoderLayer": lambda attention: getattr(attention.config, "sliding_window", None),
    "Qwen2DecoderLayer": lambda attention: attention.sliding_window,
    "Qwen3DecoderLayer": lambda attention: attention.sliding_window,
}


def _norms_heads(attention: LlamaAttention) -> TypeIs[HeadNormedAttention]:
    return hasattr(attention, "q_norm") and hasattr(attention, "k_norm")


class LayerReplacement(nn.Module):
    """A module that stands in for the decoder layer it holds as ``layer``: the
    attributes it does not have itself are the layer's (those the decoder reads,
    such as ``attention_type``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)


class FusedDecoderLayer(LayerReplacement):
    """A Llama-family decoder layer's forward with the fused kernels, fused residual
    adds and in-place rotation (see the module docstring). ``layer`` is the original,
    whose submodules it calls, whose forward runs whatever this one does not take,
    and whose other attributes (those the decoder reads, such as ``attention_type``)
    it answers for."""

    layer: LlamaDecoder  # registered as a submodule; typed by what is read of it
    packed_qkv: PackedWeight | None
    qkv_bias: torch.Tensor | None

    def __init__(self, layer: LlamaDecoder, attend: AttentionFunction, is_last: bool, rows_hint: int) -> None:
        super().__init__()
        self.layer = layer
        self.attend = attend  # the engine's attention function, as registered with transformers
        self.sliding_window = LAYER_WINDOWS[type(layer).__name__](layer.self_attn)
        self.is_last = is_last  # the decoder's last layer feeds only its final norm and the LM head
        attention = layer.self_attn
        # With the engine's own attention function, its backend is called directly (see
        # _attend), with the options that function would build on each call.
        self.attends_in_context = (attend is paged_attention_forward and isinstance(attention.layer_idx, int)
                                   and attention.layer_idx >= 0)
        scale = attention.scaling if attention.scaling is not None else float(attention.head_dim) ** -0.5
        self.attention_options = AttentionOptions(scale, sliding_window=self.sliding_window)
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        # q, k and v as one matmul over their weights packed side by side (not LoRA wrappers).
        self.packed_qkv, self.qkv_bias, self.qkv_sizes = None, None, [p.out_features for p in projections]
        self.stacked_qkv: QuantizedLinear | None = None
        # Read on every call, so looked up once here: whether the attention norms each
        # head (Qwen3), and the dtype of the weights q, k and v were packed from.
        self.norms_heads = _norms_heads(attention)
        self.qkv_dtype: torch.dtype | None = None
        if packable_side_by_side(projections):
            self.packed_qkv, self.qkv_bias = pack_side_by_side(projections, rows_hint)
            self.qkv_dtype = projections[0].weight.dtype
        else:  # quantized q, k and v as one stacked call where they agree (quantization/stacked.py)
            self.stacked_qkv = stacked_projection(projections)[0]

    def forward(self, hidden_states: torch.Tensor, *args: Any,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                shardline_ctx: AttentionContext | None = None, **kwargs: Any) -> torch.Tensor:
        # hidden_states: [1, T, hidden] -> [1, T, hidden]
        if (args or shardline_ctx is None or position_embeddings is None or torch.is_grad_enabled()
                or hidden_states.dtype not in FUSED_DTYPES):
            return self.layer(hidden_states, *args, position_embeddings=position_embeddings,
                              shardline_ctx=shardline_ctx, **kwargs)
        # Submodules read from their dicts: through Module.__getattr__ (and this class's)
        # each costs a few lookups, a dozen times a layer a step.
        parts = cast(nn.Module, self._modules["layer"])._modules
        attention_module = cast(nn.Module, parts["self_attn"])
        attention = cast(LlamaAttention, attention_module)
        head_dim = attention.head_dim
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        tokens = x.shape[0]
        if self.is_last and _reads_sampled_rows_only(shardline_ctx, tokens):
            return _sampled_rows_forward(self, x, position_embeddings, shardline_ctx).view(hidden_states.shape)
        normed = norm_rows(cast(nn.Module, parts["input_layernorm"]), x)
        query, key, value = self._project_qkv(attention, normed)
        if self.norms_heads and _norms_heads(attention):  # Qwen3: a norm over each head before the rotation
            query = norm_heads(attention.q_norm, query).view(tokens, -1, head_dim)
            key = norm_heads(attention.k_norm, key).view(tokens, -1, head_dim)
        cos, sin = position_embeddings
        rotary_(query, key, cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim))
        attended = self._attend(attention, query, key, value, shardline_ctx)
        # The residual stream: x + attention's output, summed into o_proj's fresh output.
        residual = cast(nn.Module, attention_module._modules["o_proj"])(attended.reshape(tokens, -1))
        normed = add_norm_rows(cast(nn.Module, parts["post_attention_layernorm"]), residual, x)
        return _add_residual(cast(nn.Module, parts["mlp"])(normed), residual).view(hidden_states.shape)

    def _attend(self, attention: LlamaAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """The attention function's output for queries [T, H, D], keys and values [T, Hkv, D]:
        [T, H, Dv] (or [1, T, H, Dv]). The engine's own function is skipped for the backend
        it calls, without the [1, H, T, D] views there and back."""
        if self.attends_in_context:
            return attend_in_context(ctx, attention.layer_idx, query, key, value, self.attention_options)
        attended, _ = self.attend(
            attention, query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], None,
            dropout=0.0, scaling=attention.scaling, sliding_window=self.sliding_window, shardline_ctx=ctx)
        return attended

    def _project_qkv(self, attention: LlamaAttention, x: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [T, H, D], keys and values [T, Hkv, D] of x [T, hidden] (``attention``
        is the layer's): one matmul over the three weights packed side by side when
        they were (views of its output, rows of D contiguous), or the quantized ones
        stacked, else the three projections."""
        tokens, head_dim = x.shape[0], attention.head_dim
        stacked_qkv = self._modules.get("stacked_qkv")  # a submodule when set (see forward)
        if stacked_qkv is not None:
            query, key, value = stacked_qkv(x).split(self.qkv_sizes, dim=-1)
        elif self.packed_qkv is None or x.dtype != self.qkv_dtype:
            query, key, value = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        else:
            query, key, value = packed_matmul(x, self.packed_qkv, self.qkv_bias).split(self.qkv_sizes, dim=-1)
        return query.view(tokens, -1, head_dim), key.view(tokens, -1, head_dim), value.view(tokens, -1, head_dim)


def _add_residual(out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """out += residual (both [T, hidden]), through the fused kernel where it takes them
    (one C call, which a recorded decode step replays; cpu/decode_programs.py)."""
    if out.dim() == 2 and out.stride(1) == 1 and residual.stride(1) == 1 and out.dtype == residual.dtype:
        return add_(out, residual)
    return out.add_(residual)


def _reads_sampled_rows_only(ctx: AttentionContext, tokens: int) -> bool:
    """Whether the step reads this (last) layer's output at its sampled rows alone,
    fewer than all (the runner marks them only where the backend attends them, with
    the native decode kernel)."""
    return ctx.sampled_rows is not None and ctx.sampled_rows.numel() < tokens


def _sampled_rows_forward(self: FusedDecoderLayer, x: torch.Tensor,
                          position_embeddings: tuple[torch.Tensor, torch.Tensor],
                          ctx: AttentionContext) -> torch.Tensor:
    """The last layer when only the sampled rows' outputs are read (the final norm and
    the LM head see nothing else): keys and values of every new token go into the
    cache, but queries, attention, o_proj and the MLP run on the sampled rows only,
    each a request's last token attending its whole context (one query per request,
    as in decoding), through the backend's ``attend_sampled_rows``. Other rows of the
    result are zeros. x: [T, hidden] -> [T, hidden]."""
    layer, attention = self.layer, self.layer.self_attn
    head_dim, tokens = attention.head_dim, x.shape[0]
    rows, backend = ctx.sampled_rows, ctx.backend
    assert rows is not None and backend is not None, "a step that samples some rows (_reads_sampled_rows_only)"
    normed = norm_rows(layer.input_layernorm, x)
    key = attention.k_proj(normed).view(tokens, -1, head_dim)
    value = attention.v_proj(normed).view(tokens, -1, head_dim)
    norms_heads = _norms_heads(attention)
    if norms_heads:
        key = norm_rows(attention.k_norm, key.reshape(-1, head_dim)).view(tokens, -1, head_dim)
    cos, sin = (table.reshape(tokens, head_dim) for table in position_embeddings)
    rotary_(key, None, cos, sin)
    if rows.numel():
        query = attention.q_proj(normed.index_select(0, rows)).view(rows.numel(), -1, head_dim)
        if norms_heads:
            query = norm_rows(attention.q_norm, query.reshape(-1, head_dim)).view(rows.numel(), -1, head_dim)
        rotary_(query, None, cos.index_select(0, rows), sin.index_select(0, rows))
    else:  # a step of partial prefill chunks only: keys and values are cached, nothing is read
        query = x.new_empty((0, self.qkv_sizes[0] // head_dim, head_dim))
    options = AttentionOptions(attention.scaling, sliding_window=self.sliding_window)
    attended = backend.attend_sampled_rows(ctx, attention.layer_idx, query, key, value, options)
    if rows.numel() == 0:
        return x.new_zeros(x.shape)
    residual = attention.o_proj(attended.view(rows.numel(), -1))
    normed = add_norm_rows(layer.post_attention_layernorm, residual, x.index_select(0, rows))
    out = x.new_zeros(x.shape)
    return out.index_copy_(0, rows, _add_residual(layer.mlp(normed), residual))


def _has_llama_layout(layer: object) -> TypeIs[LlamaDecoder]:
    attention = getattr(layer, "self_attn", None)
    return (type(layer).__name__ in LAYER_WINDOWS and attention is not None
            and all(hasattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim",
                                                          "scaling", "config", "layer_idx"))
            and all(hasattr(layer, name) for name in ("input_layernorm", "post_attention_layernorm", "mlp")))


def _probe_layer(layer: nn.Module, attention: LlamaAttention, rotary_emb: nn.Module, hidden_size: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """The output of ``layer`` (a decoder layer or its replacement, ``attention`` the
    original's attention) for the probe request (cpu/probe.py)."""
    cache = probe_cache(attention.k_proj.out_features // attention.head_dim, attention.head_dim, dtype)
    ctx = probe_context([cache] * (attention.layer_idx + 1), attention.q_proj.out_features // attention.head_dim)
    return probe_layer(layer, rotary_emb, hidden_size, dtype, ctx)


def fuse_decoder_layers(model: nn.Module, rows_hint: int) -> int:
    """Replace every Llama-family decoder layer by a FusedDecoderLayer where that gives
    the layer's own output on a probe step (see the module docstring); returns how
    many were replaced. ``rows_hint`` is the row count oneDNN tunes the packed query,
    key and value weights for (see cpu/linear.py, pack_linears)."""
    num_layers = replace_decoder_layers(model, lambda layer, position, rotary_emb, is_last: _fused_layer(
        layer, rotary_emb, is_last=is_last, rows_hint=rows_hint))
    if num_layers:  # a decoder whose every layer is fused runs without transformers' plumbing
        decoders = fuse_decoders(model, lambda layer: isinstance(layer, FusedDecoderLayer), same_output)
        logger.info("fused decoder forwards: %d", decoders)
    return num_layers


# replacement(layer, position, rotary_emb, is_last): the layer's replacement, or None.
LayerReplacer = Callable[[nn.Module, int, nn.Module, bool], "nn.Module | None"]


def replace_decoder_layers(model: nn.Module, replacement: LayerReplacer) -> int:
    """In every decoder of ``model`` (a module with ``layers`` and ``rotary_emb``), put
    ``replacement(layer, position, rotary_emb, is_last)`` in each layer's place where it
    returns a module (None keeps the layer), through surgery.replace; returns how many
    were replaced."""
    num_replaced = 0
    for decoder_name, decoder in list(model.named_modules()):
        layers, rotary_emb = decoder._modules.get("layers"), decoder._modules.get("rotary_emb")
        if not isinstance(layers, nn.ModuleList) or rotary_emb is None:
            continue
        for position, layer in enumerate(layers):
            replaced = replacement(layer, position, rotary_emb, position == len(layers) - 1)
            if replaced is not None:
                replace(model, ".".join(filter(None, (decoder_name, "layers", str(position)))), replaced)
                num_replaced += 1
    return num_replaced


def _fused_layer(layer: nn.Module, rotary_emb: nn.Module, is_last: bool, rows_hint: int) -> FusedDecoderLayer | None:
    """The layer's replacement, or None where it does not fit or would differ."""
    if not _has_llama_layout(layer):
        return None
    attention = layer.self_attn
    # A quantized o_proj (engine/quantization/) holds no float weight: the layer's dtype
    # and width are its input norm's.
    weight = (attention.o_proj.weight if isinstance(attention.o_proj, nn.Linear)
              else getattr(layer.input_layernorm, "weight", None))
    if not isinstance(weight, torch.Tensor):
        return None
    if weight.device.type != "cpu" or weight.dtype not in FUSED_DTYPES or not fused_kernels_available(weight.dtype):
        return None
    attend = ALL_ATTENTION_FUNCTIONS.get(attention.config._attn_implementation)
    if attend is None:
        return None
    try:
        fused = FusedDecoderLayer(layer, attend, is_last, rows_hint)
    except Exception:  # a layer the fused forward does not fit
        fused = None
    if fused is None or not probe_matches(layer, fused, lambda module: _probe_layer(
            module, attention, rotary_emb, weight.shape[0], weight.dtype), same_output):
        logger.info("%s does not match the fused Llama-family forward; it keeps its own", type(layer).__name__)
        return None
    if fused.packed_qkv is not None and not is_last:
        # Their own packed copies are no longer read (the last layer's sampled rows
        # still project keys and values alone, queries at fewer rows).
        for name in ("q_proj", "k_proj", "v_proj"):
            projection = layer.get_submodule(f"self_attn.{name}")
            if isinstance(projection, PackedLinear):
                replace(layer, f"self_attn.{name}", projection.unpacked())
    return fused
