"""Adapters by attention shape: how each kind of attention module transformers never
routed through its AttentionInterface makes its queries, keys and values, which
attention options it has and what it returns. Each reads the original module's own
projections, flags and position encodings (its model file's rotary and ALiBi
functions), so a checkpoint's variant (bias, partial rotary, multi-query, ALiBi or
rotary) is the one its config says.

Shapes:
- separate query/key/value projections and an output projection (gpt_neo, with its
  local layers as a sliding window and no score scaling; xglm, query pre-scaled);
- one fused Conv1D projection split in thirds (openai-gpt);
- one fused projection laid out per head (bloom and falcon as [H, 3, D], falcon's
  multi-query and grouped layouts, gpt_neox_japanese as [H, 3D]), with rotary
  embeddings (falcon, gpt_neox_japanese), ALiBi slopes (bloom) or ALiBi as a bias
  table by key position (falcon with alibi);
- one fused projection split in thirds with ALiBi or learned positions (mpt).

ALiBi: bloom's and mpt's bias is slope_h * key position (in transformers' own
precision); the paged attention adds slope_h * (key - query position), the same scores
up to a constant per query, which the softmax cancels. falcon's is rounded to bfloat16
per position, so it is passed as a table by key position (FalconAttention). """

from __future__ import annotations

import math
import sys

import torch
from torch import nn
from transformers import PretrainedConfig

from .base import PagedAttentionAdapter, StepScope, layer_attribute, layer_flag, layer_scale


def _model_function(module: nn.Module, name: str):
    """A function of the original module's modeling file (its rotary or ALiBi code)."""
    return getattr(sys.modules[type(module).__module__], name)


def _config(module: nn.Module) -> PretrainedConfig:
    """The original module's model config."""
    return layer_attribute(module, "config", PretrainedConfig)


def _apply_rotary(module: nn.Module, query: torch.Tensor, key: torch.Tensor, position_embeddings,
                  rotary_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own rotary embedding on the first ``rotary_dims`` of each head.
    query: [T, H, D], key: [T, Hkv, D]; cos, sin: [1, T, rotary_dims]."""
    cos, sin = position_embeddings
    apply = _model_function(module, "apply_rotary_pos_emb")
    q, k = query.transpose(0, 1)[None], key.transpose(0, 1)[None]  # [1, H, T, D]
    q_rot, k_rot = apply(q[..., :rotary_dims], k[..., :rotary_dims], cos, sin)
    q = torch.cat((q_rot, q[..., rotary_dims:]), dim=-1)
    k = torch.cat((k_rot, k[..., rotary_dims:]), dim=-1)
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


def _alibi_slopes(alibi: torch.Tensor) -> torch.Tensor:
    """[H] slopes from a model's ALiBi bias over two key positions ([H, 1, 2]):
    the bias grows by one slope per position."""
    return (alibi[:, 0, 1] - alibi[:, 0, 0]).float()


class SeparateProjectionsAttention(PagedAttentionAdapter):
    """q_proj, k_proj, v_proj and out_proj over [T, hidden], heads of hidden / H.
    ``query_scaling``: the original multiplies its query projection by its
    ``scaling`` (xglm); else scores are scaled by ``scores_scale`` (gpt_neo: 1)."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    out_proj: nn.Module
    query_scaling = False
    scores_scale: float | None = None

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self.num_heads = layer_attribute(original, "num_heads", int)
        self.head_dim = layer_attribute(original, "head_dim", int)
        if self.query_scaling:
            self._query_scale = layer_scale(original, "scaling")
            self.scale = 1.0
        else:
            self.scale = self.scores_scale if self.scores_scale is not None else self.head_dim ** -0.5

    def project(self, hidden_states, call):
        query = self.q_proj(hidden_states)
        if self.query_scaling:
            query = query * self._query_scale
        shape = (hidden_states.shape[0], -1, self.head_dim)
        return (query.view(shape), self.k_proj(hidden_states).view(shape), self.v_proj(hidden_states).view(shape))

    def finish(self, attention, call):
        return self.out_proj(attention), None


class GPTNeoAttention(SeparateProjectionsAttention):
    """GPT-Neo: unscaled scores (in float32, as transformers); its "local" layers see
    the last ``window_size`` tokens."""

    scores_scale = 1.0

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        if layer_attribute(original, "attention_type", str) == "local":
            self.sliding_window = _config(original).window_size


class XGLMAttention(SeparateProjectionsAttention):
    query_scaling = True


class OpenAIGPTAttention(PagedAttentionAdapter):
    """openai-gpt: c_attn (Conv1D) gives [q | k | v]; scores scaled when ``scale``."""

    c_attn: nn.Module
    c_proj: nn.Module

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self.num_heads = layer_attribute(original, "n_head", int)
        self._split_size = layer_attribute(original, "split_size", int)
        self.head_dim = self._split_size // self.num_heads
        self.scale = self.head_dim ** -0.5 if layer_flag(original, "scale") else 1.0

    def project(self, hidden_states, call):
        query, key, value = self.c_attn(hidden_states).split(self._split_size, dim=-1)
        shape = (hidden_states.shape[0], self.num_heads, self.head_dim)
        return query.reshape(shape), key.reshape(shape), value.reshape(shape)

    def finish(self, attention, call):
        return [self.c_proj(attention)]


class GPTNeoXJapaneseAttention(PagedAttentionAdapter):
    """gpt_neox_japanese: query_key_value laid out [H, 3D]; partial rotary; returns the
    output, no weights, and its separate output bias."""

    query_key_value: nn.Module
    dense: nn.Module

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self.num_heads = layer_attribute(original, "num_attention_heads", int)
        self.head_dim = layer_attribute(original, "head_size", int)
        self.scale = 1.0 / layer_scale(original, "norm_factor")
        self._rotary_dims = layer_attribute(original, "rotary_ndims", int)

    def project(self, hidden_states, call):
        qkv = self.query_key_value(hidden_states).view(hidden_states.shape[0], self.num_heads, 3 * self.head_dim)
        query, key, value = qkv.split(self.head_dim, dim=-1)
        query, key = _apply_rotary(self.original, query, key, call["position_embeddings"], self._rotary_dims)
        return query, key, value

    def finish(self, attention, call):
        return self.dense(attention), None, self.original.dense_bias


class FalconAttention(PagedAttentionAdapter):
    """falcon: query_key_value as [H, 3, D] (the original layout), [H + 2, D]
    (multi-query: one key and one value head) or [Hkv, H / Hkv + 2, D] (the new
    decoder architecture); rotary embeddings, or ALiBi (``alibi=True``).

    ALiBi: the reference is transformers' SDPA attention, its default for falcon and
    the original Falcon-RW math: scores q.k / sqrt(D) + alibi / sqrt(D), the bias added
    once, through the mask FalconModel builds. Before transformers 5.25 the layer is
    also passed ``alibi``, and its eager attention adds the bias in its scores and
    again in that mask, twice. The model's build_alibi_tensor rounds each
    slope to bfloat16 and its product with the key position to bfloat16 again, so the
    bias is not slope * position: the layer attends with the model's own values as a
    bias table by key position (AttentionOptions.position_bias), [H, L] divided as
    FalconModel divides them, which the torch attention path takes. Outside a step (the
    load check's reference runs the model eager) an ``alibi`` passed to the original is
    zeroed, so it adds the mask's bias once, as its SDPA attention does. Whether the
    layer uses ALiBi or rotary embeddings is its config's ``alibi``."""

    query_key_value: nn.Module
    dense: nn.Module

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self.num_heads = layer_attribute(original, "num_heads", int)
        self.head_dim = layer_attribute(original, "head_dim", int)
        self.scale = layer_scale(original, "inv_norm_factor")
        self._new_decoder_architecture = layer_flag(original, "new_decoder_architecture")
        self._multi_query = layer_flag(original, "multi_query")
        self._num_kv_heads = layer_attribute(original, "num_kv_heads", int)
        self._config = _config(original)
        self._bias_table: torch.Tensor | None = None  # [H, L] ALiBi by key position, grown as contexts grow

    def forward(self, *args, **kwargs):
        if self._scope.ctx is None and self._config.alibi:
            call = self._signature.bind(*args, **kwargs)
            if call.arguments.get("alibi") is not None:
                call.arguments["alibi"] = torch.zeros_like(call.arguments["alibi"])
            return self.original(*call.args, **call.kwargs)
        return super().forward(*args, **kwargs)

    @property
    def uses_position_bias(self) -> bool:
        return bool(self._config.alibi)

    def position_bias_for(self, call, query):
        if not self._config.alibi:
            return None
        ctx = self._scope.ctx
        assert ctx is not None, "position_bias_for is asked inside a step"
        length = ctx.max_seq_len
        table = self._bias_table
        if table is None or table.shape[1] < length or table.dtype != query.dtype or table.device != query.device:
            table = self._bias_table = self._alibi_table(max(256, 1 << (length - 1).bit_length()), query)
        return table

    def _alibi_table(self, length: int, query: torch.Tensor) -> torch.Tensor:
        """[H, length]: the model's ALiBi bias at key positions 0 .. length - 1, in
        ``query``'s dtype, divided by sqrt(head size) as FalconModel divides it."""
        config = self._config
        mask = torch.ones((1, length), dtype=torch.long, device=query.device)  # the model's own mask dtype
        alibi = _model_function(self.original, "build_alibi_tensor")(mask, self.num_heads, query.dtype)
        return alibi[:, 0] / math.sqrt(config.hidden_size // self.num_heads)

    def project(self, hidden_states, call):
        tokens = hidden_states.shape[0]
        fused = self.query_key_value(hidden_states)
        if self._new_decoder_architecture:
            qkv = fused.view(tokens, self._num_kv_heads, -1, self.head_dim)
            query = qkv[:, :, :-2].reshape(tokens, self.num_heads, self.head_dim)
            key, value = qkv[:, :, -2], qkv[:, :, -1]
        elif self._multi_query:
            qkv = fused.view(tokens, self.num_heads + 2, self.head_dim)
            query, key, value = qkv[:, :-2], qkv[:, -2:-1], qkv[:, -1:]
        else:
            qkv = fused.view(tokens, self.num_heads, 3, self.head_dim)
            query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if not self._config.alibi:
            query, key = _apply_rotary(self.original, query, key, call["position_embeddings"], self.head_dim)
        return query, key, value

    def finish(self, attention, call):
        return self.dense(attention), None


class BloomAttention(PagedAttentionAdapter):
    """bloom: query_key_value as [H, 3, D], ALiBi, and the residual added inside."""

    query_key_value: nn.Module
    dense: nn.Module

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self.num_heads = layer_attribute(original, "num_heads", int)
        self.head_dim = layer_attribute(original, "head_dim", int)
        self.scale = layer_scale(original, "inv_norm_factor")
        alibi = _model_function(original, "build_alibi_tensor")(torch.ones(1, 2), self.num_heads, torch.float32)
        self.alibi_slopes = _alibi_slopes(alibi) * layer_scale(original, "beta")

    def project(self, hidden_states, call):
        qkv = self.query_key_value(hidden_states).view(hidden_states.shape[0], self.num_heads, 3, self.head_dim)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def finish(self, attention, call):
        return self.dense(attention) + call["residual"], None


class MptAttention(PagedAttentionAdapter):
    """mpt: Wqkv split in thirds (clipped where the config says), ALiBi when the model
    passes a position bias."""

    Wqkv: nn.Module
    out_proj: nn.Module

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self.num_heads = layer_attribute(original, "n_heads", int)
        self.head_dim = layer_attribute(original, "head_dim", int)
        self.scale = layer_scale(original, "softmax_scale")
        self._clip_qkv = None if original.clip_qkv is None else layer_scale(original, "clip_qkv")
        self._slopes = _alibi_slopes(_model_function(original, "build_mpt_alibi_tensor")(self.num_heads, 2))

    def alibi_slopes_for(self, call):
        return None if call.get("position_bias") is None else self._slopes

    def project(self, hidden_states, call):
        qkv = self.Wqkv(hidden_states)
        if self._clip_qkv:
            qkv = qkv.clamp(min=-self._clip_qkv, max=self._clip_qkv)
        shape = (hidden_states.shape[0], self.num_heads, self.head_dim)
        query, key, value = qkv.chunk(3, dim=-1)
        return query.reshape(shape), key.reshape(shape), value.reshape(shape)

    def finish(self, attention, call):
        return self.out_proj(attention), None


class DiffLlamaAttention(PagedAttentionAdapter):
    """diffllama's differential attention: one softmax over the keys weighs two value
    sets, the first and the second half of the key-value heads, each tiled over all
    of them; the two outputs are combined as out1 - lambda * out2, normalised and
    projected. transformers runs two attention calls; here one call attends values
    that are the two sets side by side (head size 2D, as the cache spec holds them for
    diffllama), which gives both outputs at once."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    groupnorm: nn.Module
    # The original's own parameters, taken over under their names (the same objects).
    lambda_q1: nn.Parameter
    lambda_k1: nn.Parameter
    lambda_q2: nn.Parameter
    lambda_k2: nn.Parameter

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self.head_dim = layer_attribute(original, "head_dim", int)
        self.scale = layer_scale(original, "scaling")
        self._lambda_init = layer_scale(original, "lambda_init")

    def project(self, hidden_states, call):
        tokens = hidden_states.shape[0]
        query = self.q_proj(hidden_states).view(tokens, -1, self.head_dim)
        key = self.k_proj(hidden_states).view(tokens, -1, self.head_dim)
        value = self.v_proj(hidden_states).view(tokens, -1, self.head_dim)  # [T, Hkv, D]
        query, key = _apply_rotary(self.original, query, key, call["position_embeddings"], self.head_dim)
        first, second = value.chunk(2, dim=1)  # each [T, Hkv / 2, D], tiled back to Hkv heads
        return query, key, torch.cat((first.repeat(1, 2, 1), second.repeat(1, 2, 1)), dim=-1)

    def finish(self, attention, call):
        tokens = attention.shape[1]
        both = attention.view(1, tokens, -1, 2 * self.head_dim)  # [1, T, H, 2D]: out1 | out2 per head
        # transformers concatenates the two calls' outputs on the last axis and then
        # splits the heads in two: the first half of the heads combines with the second.
        out1, out2 = both.chunk(2, dim=2)
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1, dtype=torch.float32))
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1, dtype=torch.float32))
        lambda_full = lambda_1.to(both.dtype) - lambda_2.to(both.dtype) + self._lambda_init
        combined = (1 - self._lambda_init) * self.groupnorm(out1 - lambda_full * out2)
        return self.o_proj(combined.reshape(1, tokens, -1)), None
