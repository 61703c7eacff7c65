"""What the CPU path's replacements read of the transformers modules they replace.

A replacement holds the module it replaces (registered as its submodule) and calls
that module's own submodules on every step: a decoder layer's projections and norms,
an MLP's gate, up and down projections. torch types a module's children as
``Tensor | Module``; these Protocols type them by what is read of them instead. Each
is checked where the replacement is built (the ``TypeIs`` guards in
layers.py, linear.py and hybrid_decoder.py), never per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from transformers import PretrainedConfig

from ..recurrent.state import RecurrentLayer


class WeightedNorm(Protocol):
    """A norm with a ``weight`` tensor (RMSNorm-like), as a fused norm reads it."""

    weight: torch.Tensor

    def __call__(self, x: torch.Tensor, /) -> torch.Tensor: ...


class GatedMLP(Protocol):
    """What FusedGatedMLP reads of the MLP it replaces. Gate and up are PackedLinears
    when the MLP is fused, plain nn.Linears on the same parameters after (their packed
    copies are no longer read)."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Module
    act_fn: Callable[[torch.Tensor], torch.Tensor]


class Projection(Protocol):
    """A decoder layer's linear as the fused forward reads it: an nn.Linear, a
    PackedLinear, or a LoRA wrapper of either (engine/lora/layers.py)."""

    @property
    def out_features(self) -> int: ...

    @property
    def weight(self) -> torch.Tensor: ...

    def __call__(self, x: torch.Tensor, /) -> torch.Tensor: ...


class LlamaAttention(Protocol):
    """What FusedDecoderLayer reads of a Llama-family attention module."""

    q_proj: Projection
    k_proj: Projection
    v_proj: Projection
    o_proj: Projection
    head_dim: int
    scaling: float
    layer_idx: int
    config: PretrainedConfig


class HeadNormedAttention(LlamaAttention, Protocol):
    """Qwen3's attention: a norm over each query and key head before the rotation."""

    q_norm: nn.Module
    k_norm: nn.Module


class LlamaDecoder(Protocol):
    """What FusedDecoderLayer reads of a Llama-family decoder layer."""

    self_attn: LlamaAttention
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class GatedAttention(HeadNormedAttention, Protocol):
    """What FusedHybridDecoderLayer reads of a hybrid's gated full attention (Qwen3.5's,
    Qwen3-Next's): Qwen3's layout, but q_proj gives each head's queries and output gates
    side by side ([H, 2, D] per row)."""


class HybridDecoder(Protocol):
    """What FusedHybridDecoderLayer reads of a hybrid decoder layer (Qwen3.5,
    Qwen3-Next), whichever its mixer."""

    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class GatedAttentionDecoder(HybridDecoder, Protocol):
    """A hybrid decoder layer whose mixer is gated full attention."""

    self_attn: GatedAttention


class RecurrentDecoder(HybridDecoder, Protocol):
    """A hybrid decoder layer whose mixer is a recurrent layer (a gated delta-net run
    through the engine's RecurrentLayer)."""

    linear_attn: RecurrentLayer


# transformers' attention functions (ALL_ATTENTION_FUNCTIONS): (module, query, key,
# value, mask, **options) -> (output [1, T, H, Dv], attention weights or None).
AttentionFunction = Callable[..., "tuple[torch.Tensor, torch.Tensor | None]"]
