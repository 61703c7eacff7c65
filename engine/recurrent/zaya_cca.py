"""ZAYA's compressed convolutional attention (CCA) projection: the recurrent half of
its "hybrid" layers, whose other half is ordinary attention on the paged KV cache.

Per token, read in transformers' ZayaCCAProjection: the query and key projections,
side by side, go through two stacked causal convolutions (a depthwise one of width
cca_time0, then one of width cca_time1 that mixes the channels of each head), and
each adds a residual of the projections (the query and repeated key heads averaged;
the key residual that average's mean over each key head's group); half of each value
head is the token's own projection, the other half the previous token's "delayed"
projection. A request's state is therefore its last K = (cca_time0 - 1) +
(cca_time1 - 1) query|key projections (zeros before its first token) and the delayed
value projection of its last token (before its first token: the projection of a zero
hidden state, as the module computes it).

The kind returns query, key and value packed in one [T, (Hq + 2 Hkv) * D] tensor (a
layer's output is one tensor), which ``module_output`` unpacks into the module's
(query, key, value); the attention that follows runs on the engine's paged cache.

Invariants: every token's convolution reads exactly the K projections before it in
its own request (from the state where they precede the step), so any split of a
request into chunks gives the same outputs.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from .base import RecurrentKind, StateShapes, projection_out_features, projection_weight, register_kind


class ZayaCCAModule(Protocol):
    """What the kind reads of transformers' ZayaCCAProjection; projections typed as any
    module (LoRA wraps them)."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj_current: nn.Module
    v_proj_delayed: nn.Module
    conv_qk_depthwise: nn.Conv1d
    conv_qk_grouped: nn.Conv1d
    conv_kernel_size: int  # K: the two convolutions' widths less one each
    head_dim: int
    num_attention_heads: int
    num_key_value_heads: int
    num_key_value_groups: int


class ZayaCCAKind(RecurrentKind):
    """ZayaCCAProjection: convolved queries and keys, half-delayed values."""

    name = "zaya_cca"

    def state_shapes(self, hf_module: torch.nn.Module, hf_config) -> StateShapes:
        m = cast(ZayaCCAModule, hf_module)
        dtype = projection_weight(m.q_proj).dtype
        channels = m.conv_qk_depthwise.in_channels
        return {
            "conv": ((m.conv_kernel_size, channels), dtype),
            "delayed_value": ((projection_out_features(m.v_proj_delayed),), dtype),
        }

    def forward(self, hf_module: torch.nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                has_initial_state: torch.Tensor, states: dict[str, torch.Tensor]) -> torch.Tensor:
        # hidden_states: [T, hidden]; states["conv"]: [B, K, C]; states["delayed_value"]: [B, Vd]
        m = cast(ZayaCCAModule, hf_module)
        num_tokens = hidden_states.shape[0]
        head_dim, groups = m.head_dim, m.num_key_value_groups
        queries, keys = m.q_proj(hidden_states), m.k_proj(hidden_states)
        # The residuals, in the module's own order of operations.
        key_heads = keys.view(num_tokens, -1, head_dim)
        query_residual = (queries.view(num_tokens, -1, head_dim) + key_heads.repeat_interleave(groups, dim=1)) * 0.5
        key_residual = query_residual.view(num_tokens, -1, groups, head_dim).mean(dim=-2)

        qk = torch.cat([queries, keys], dim=-1)  # [T, C]
        fresh = ~has_initial_state
        conv_state = states["conv"]
        conv_state.masked_fill_(fresh[:, None, None], 0)
        windows, source, last_rows = _windows(qk, conv_state, cu_seqlens)
        mixed = m.conv_qk_grouped(m.conv_qk_depthwise(windows.transpose(1, 2)))[..., 0]  # [T, C]
        conv_state.copy_(source[last_rows])
        query_width = queries.shape[-1]
        query = mixed[:, :query_width].view(num_tokens, -1, head_dim) + query_residual
        key = mixed[:, query_width:].view(num_tokens, -1, head_dim) + key_residual

        value_current, delayed = m.v_proj_current(hidden_states), m.v_proj_delayed(hidden_states)
        delayed_state = states["delayed_value"]
        zero_delayed = m.v_proj_delayed(hidden_states.new_zeros(1, hidden_states.shape[-1]))[0]
        delayed_state.copy_(torch.where(fresh[:, None], zero_delayed, delayed_state))
        starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
        previous = torch.cat([delayed[:1], delayed[:-1]])  # each token's predecessor's delayed projection
        previous[starts] = delayed_state  # a request's first token reads its state
        delayed_state.copy_(delayed[ends - 1])
        value = torch.cat([value_current, previous], dim=-1).view(num_tokens, -1, head_dim)
        return torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=-1)

    def module_output(self, hf_module: torch.nn.Module, packed: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """packed [1, T, (Hq + 2 Hkv) * D] -> (query [1, T, Hq, D], key, value [1, T, Hkv, D])."""
        m = cast(ZayaCCAModule, hf_module)
        query_width = m.num_attention_heads * m.head_dim
        key_width = m.num_key_value_heads * m.head_dim
        query, key, value = packed.split([query_width, key_width, key_width], dim=-1)
        shape = (*packed.shape[:2], -1, m.head_dim)
        return query.reshape(shape), key.reshape(shape), value.reshape(shape)


def _windows(qk: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's K+1 convolution inputs [T, K+1, C] (its request's K projections
    before it, then its own), the source they come from (the state rows, then qk:
    [B*K + T, C]) and the source rows holding each request's last K inputs [B, K]
    (its next state)."""
    num_requests, history, _ = conv_state.shape
    device = qk.device
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    request = torch.repeat_interleave(torch.arange(num_requests, device=device), lengths, output_size=qk.shape[0])
    offset = torch.arange(qk.shape[0], device=device) - cu_seqlens[:-1][request]

    def rows(req: torch.Tensor, extended: torch.Tensor) -> torch.Tensor:
        # Position j of a request's extended sequence (its K state rows, then its tokens).
        from_state = req * history + extended
        from_tokens = num_requests * history + cu_seqlens[:-1][req] + extended - history
        return torch.where(extended < history, from_state, from_tokens)

    taps = torch.arange(history + 1, device=device)
    window_rows = rows(request[:, None], offset[:, None] + taps)  # token i reads extended i .. i+K
    last_rows = rows(torch.arange(num_requests, device=device)[:, None], lengths[:, None] + taps[:-1])
    source = torch.cat([conv_state.reshape(-1, qk.shape[-1]), qk])
    return source[window_rows], source, last_rows


ZAYA_CCA = register_kind(ZayaCCAKind(), ("ZayaCCAProjection",), model_types=("zaya",),
                         layer_types=("hybrid", "hybrid_sliding"))
