"""The short-convolution layer of LFM2-family models (lfm2, lfm2_moe, lfm3).

The layer projects each token to (B, C, x), convolves B*x causally over the last W
tokens (W: ``conv_L_cache``), gates the result with C and projects it back. A
request's state is its last W - 1 convolution inputs.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from .base import RecurrentKind, StateShapes, register_kind
from .conv_varlen import causal_conv1d_varlen


class ShortConvModule(Protocol):
    """What the kind reads of the transformers modules registered for it (below);
    projections typed as any module (LoRA wraps them)."""

    in_proj: nn.Module
    out_proj: nn.Module
    conv: nn.Conv1d  # depthwise, weight [D, 1, W]


class ShortConvKind(RecurrentKind):
    """Lfm2ShortConv and its copies in lfm2_moe and lfm3."""

    name = "short_conv"
    # The convolution runs through the CPU kernel where it takes the step's tensors,
    # once chosen.
    has_native_core = True

    def state_shapes(self, hf_module: torch.nn.Module, hf_config) -> StateShapes:
        weight = cast(ShortConvModule, hf_module).conv.weight  # [D, 1, W]
        return {"conv": ((weight.shape[2] - 1, weight.shape[0]), weight.dtype)}

    def forward(self, hf_module: torch.nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                has_initial_state: torch.Tensor, states: dict[str, torch.Tensor]) -> torch.Tensor:
        # hidden_states: [T, hidden]
        m = cast(ShortConvModule, hf_module)
        b_gate, c_gate, x = m.in_proj(hidden_states).chunk(3, dim=-1)
        conv = causal_conv1d_varlen(b_gate * x, m.conv.weight[:, 0, :], m.conv.bias, cu_seqlens,
                                    has_initial_state, states["conv"], native=self.native_core)
        return m.out_proj(c_gate * conv)


SHORT_CONV = register_kind(ShortConvKind(), ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"),
                           model_types=("lfm2", "lfm2_moe", "lfm3"), layer_types=("conv",))
