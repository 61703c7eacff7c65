"""OLMo Hybrid's gated delta-net layer: Qwen3.5's layer (engine/recurrent/gated_delta_net.py)
with its own projections and one extra factor.

What differs, read in transformers' OlmoHybridGatedDeltaNet: q, k and v come from three
projections (q_proj, k_proj, v_proj) whose outputs the short convolution takes side by
side in that order, the output gate from g_proj, and beta and the log decay from
b_proj and a_proj; with ``linear_allow_neg_eigval`` beta is 2 * sigmoid(b), so a
write may flip a direction of the state (an eigenvalue of the transition below zero);
the gated norm is o_norm (normalise, weight, then silu(gate)) and the output
projection o_proj. The convolution, the l2-normalised queries and keys, the log decay
and the delta rule itself are Qwen3.5's, so its state (the convolution window and
the [K, V] matrix per value head) and its chunked and single-token paths are reused.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from .base import register_kind
from .gated_delta_net import GatedDeltaNetKind


class _OlmoHybridModule(Protocol):
    """What the kind reads of OlmoHybridGatedDeltaNet beside Qwen3.5's members
    (GatedDeltaNetModule); projections and norms typed as any module (LoRA wraps them)."""

    head_v_dim: int
    allow_neg_eigval: bool
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    g_proj: nn.Module
    b_proj: nn.Module
    a_proj: nn.Module
    o_norm: nn.Module
    o_proj: nn.Module


class OlmoHybridGatedDeltaNetKind(GatedDeltaNetKind):
    """OlmoHybridGatedDeltaNet: separate q, k, v, g, a, b projections; beta doubled
    where the model allows negative eigenvalues."""

    def projections(self, module: torch.nn.Module, hidden_states: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # hidden_states: [T, hidden]
        layer = cast(_OlmoHybridModule, module)
        mixed = torch.cat([layer.q_proj(hidden_states), layer.k_proj(hidden_states), layer.v_proj(hidden_states)],
                          dim=-1)
        z = layer.g_proj(hidden_states).reshape(hidden_states.shape[0], -1, layer.head_v_dim)
        return mixed, z, layer.b_proj(hidden_states), layer.a_proj(hidden_states)

    def write_strength(self, module: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        beta = b.sigmoid()
        return beta * 2.0 if cast(_OlmoHybridModule, module).allow_neg_eigval else beta

    def output(self, module: torch.nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        layer = cast(_OlmoHybridModule, module)
        num_tokens = core.shape[0]
        core = layer.o_norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
        return layer.o_proj(core.reshape(num_tokens, -1))


OLMO_HYBRID_GATED_DELTA_NET = register_kind(
    OlmoHybridGatedDeltaNetKind(), ("OlmoHybridGatedDeltaNet",), model_types=("olmo_hybrid",),
    layer_types=("linear_attention",))
