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

import torch

from .base import register_kind
from .gated_delta_net import GatedDeltaNetKind


class OlmoHybridGatedDeltaNetKind(GatedDeltaNetKind):
    """OlmoHybridGatedDeltaNet: separate q, k, v, g, a, b projections; beta doubled
    where the model allows negative eigenvalues."""

    def projections(self, module: torch.nn.Module, hidden_states: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # hidden_states: [T, hidden]
        mixed = torch.cat([module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)],
                          dim=-1)
        z = module.g_proj(hidden_states).reshape(hidden_states.shape[0], -1, module.head_v_dim)
        return mixed, z, module.b_proj(hidden_states), module.a_proj(hidden_states)

    def write_strength(self, module: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        beta = b.sigmoid()
        return beta * 2.0 if module.allow_neg_eigval else beta

    def output(self, module: torch.nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        num_tokens = core.shape[0]
        core = module.o_norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
        return module.o_proj(core.reshape(num_tokens, -1))


OLMO_HYBRID_GATED_DELTA_NET = register_kind(
    OlmoHybridGatedDeltaNetKind(), ("OlmoHybridGatedDeltaNet",), model_types=("olmo_hybrid",),
    layer_types=("linear_attention",))
