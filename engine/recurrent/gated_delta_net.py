"""The gated delta-net layer of Qwen3-Next and Qwen3.5 (and their MoE and text variants,
and LaraMini, whose layer is Qwen3.5's).

Per token the layer projects q, k, v (through a short causal convolution with SiLU),
a gate z and the per-head beta (write strength) and g (log decay); the gated delta
rule (engine/recurrent/delta_rule.py) turns them into outputs, which a gated RMSNorm
and the output projection finish. A request's state is its last W - 1 convolution
inputs and, per value head, the [K, V] delta-rule matrix.

The delta rule runs in float32, or in float64 for a float64 model (transformers runs
it in float32 whatever the model's dtype; the engine's result stays within that
rounding of the exact value). On the CPU, where the engine takes the recurrent kernel
(engine/cpu/paths.py), the convolution, the l2 norms and the delta rule of every
request run as one C call per layer and step (kernels/cpu_recurrent.py); otherwise
as torch ops (``_torch_core``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu_recurrent import delta_rule_core, recurrent_kernel_available
from ..kernels.recurrent_reference import l2_normalize
from .base import RecurrentKind, StateShapes, register_kind
from .conv_varlen import causal_conv1d_varlen
from .decode_split import scan_split
from .delta_rule import chunk_gated_delta_rule_varlen, gated_delta_rule_step


class PackedInputProjections(ABC):
    """A gated delta-net layer's first input projection that, through ``project``, runs
    all of the layer's input projections at once (the CPU path's packed matmul,
    engine/cpu/hybrid_layers.py): (q|k|v [T, conv_dim], z [T, Hv * Dv], b [T, Hv],
    a [T, Hv]) from hidden_states [T, hidden]."""

    @abstractmethod
    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [T, hidden] -> (q|k|v, z, b, a), each [T, its width]."""


class StridedGateNorm(nn.Module):
    """A gated delta-net layer's output norm, ``norm(x, gate)``, that takes its gate in
    any layout of x's numel (a strided view of a packed projection's output), so the
    layer passes z without copying it into rows (engine/cpu/hybrid_layers.py)."""


class GatedDeltaNetModule(Protocol):
    """What the kind reads of the transformers modules registered for it (below), beside
    their input projections (``input_projections``). Projections and norms are typed
    as any module: LoRA and the CPU paths replace them with their own."""

    conv1d: nn.Conv1d  # depthwise, weight [conv_dim, 1, W]
    A_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]
    activation: str
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    key_dim: int  # Hk * K
    value_dim: int  # Hv * V
    norm: nn.Module
    out_proj: nn.Module


class _FusedInputProjections(Protocol):
    """Qwen3-Next's input projections: q|k|v|z and b|a, reordered by the module."""

    head_v_dim: int
    in_proj_qkvz: nn.Module
    in_proj_ba: nn.Module

    def fix_query_key_value_ordering(self, mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor
                                     ) -> tuple[torch.Tensor, ...]: ...


class _SeparateInputProjections(Protocol):
    """Qwen3.5's input projections: q|k|v, z, b and a."""

    head_v_dim: int
    in_proj_qkv: nn.Module
    in_proj_z: nn.Module
    in_proj_b: nn.Module
    in_proj_a: nn.Module


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class GatedDeltaNetKind(RecurrentKind):
    """Qwen3NextGatedDeltaNet (fused qkvz and ba projections) and Qwen3_5GatedDeltaNet
    (separate qkv, z, b, a projections)."""

    name = "gated_delta_net"
    # The recurrent core (convolution to delta-rule outputs) runs through the CPU kernel
    # (kernels/cpu_recurrent.py) where it takes the step's tensors, once chosen.
    has_native_core = True
    # transformers runs the delta rule in float32 whatever the model's dtype, so the
    # model's own forward is float32-exact at best (the load check's tolerance follows).
    reference_dtype = torch.float32

    def state_shapes(self, hf_module: torch.nn.Module, hf_config) -> StateShapes:
        module = cast(GatedDeltaNetModule, hf_module)
        weight = module.conv1d.weight  # [conv_dim, 1, W]
        return {
            "conv": ((weight.shape[2] - 1, weight.shape[0]), weight.dtype),
            "recurrent": ((module.num_v_heads, module.head_k_dim, module.head_v_dim), _compute_dtype(weight.dtype)),
        }

    def forward(self, hf_module: torch.nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                has_initial_state: torch.Tensor, states: dict[str, torch.Tensor]) -> torch.Tensor:
        # hidden_states: [T, hidden]
        module = cast(GatedDeltaNetModule, hf_module)
        mixed_qkv, z, b, a = self.projections(hf_module, hidden_states)
        beta = self.write_strength(hf_module, b)
        g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)  # the module's own expression
        dtype = states["recurrent"].dtype
        if self._takes_native_core(module, mixed_qkv, states):
            core = delta_rule_core(mixed_qkv, module.conv1d.weight[:, 0, :], module.conv1d.bias,
                                   g.to(dtype).contiguous(), beta.to(dtype).contiguous(), cu_seqlens,
                                   has_initial_state, states["conv"], states["recurrent"], module.num_k_heads)
        else:
            core = _torch_core(module, mixed_qkv, g.to(dtype), beta.to(dtype), cu_seqlens, has_initial_state, states)
        return self.output(hf_module, core.to(hidden_states.dtype), z)

    def _takes_native_core(self, module: GatedDeltaNetModule, mixed_qkv: torch.Tensor,
                           states: dict[str, torch.Tensor]) -> bool:
        """The kernel runs one dtype (float32 or float64) throughout, SiLU, no gradients."""
        recurrent = states["recurrent"]
        return (self.native_core and mixed_qkv.device.type == "cpu" and not mixed_qkv.requires_grad
                and mixed_qkv.dtype == recurrent.dtype == states["conv"].dtype == module.conv1d.weight.dtype
                and module.activation == "silu"
                and recurrent_kernel_available(recurrent.dtype, recurrent.shape[2], recurrent.shape[3]))

    # What a variant of the layer (engine/recurrent/olmo_hybrid.py) computes its own way.
    def projections(self, module: torch.nn.Module, hidden_states: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q|k|v [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]) by the module's own projections."""
        return input_projections(module, hidden_states)

    def write_strength(self, module: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        """beta [T, Hv] from the b projection."""
        return b.sigmoid()

    def output(self, module: torch.nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated norm of the delta rule's output core [T, Hv, Dv] by z, then the output projection."""
        layer = cast(GatedDeltaNetModule, module)
        num_tokens = core.shape[0]
        # The fused norm takes z in any layout (no copy of a packed projection's view).
        gate = z if isinstance(layer.norm, StridedGateNorm) else z.reshape(-1, layer.head_v_dim)
        core = layer.norm(core.reshape(-1, layer.head_v_dim), gate)
        return layer.out_proj(core.reshape(num_tokens, -1))


def _torch_core(module: GatedDeltaNetModule, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor, states: dict[str, torch.Tensor]
                ) -> torch.Tensor:
    """The recurrent core in torch ops: mixed_qkv [T, conv_dim] through the convolution,
    the l2 norms and the delta rule (g, beta [T, Hv] in the state's dtype) -> [T, Hv, Dv]."""
    num_tokens = mixed_qkv.shape[0]
    dtype = states["recurrent"].dtype
    mixed_qkv = causal_conv1d_varlen(mixed_qkv, module.conv1d.weight[:, 0, :], module.conv1d.bias, cu_seqlens,
                                     has_initial_state, states["conv"], module.activation)
    query, key, value = torch.split(mixed_qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = l2_normalize(query.reshape(num_tokens, -1, module.head_k_dim).to(dtype))
    key = l2_normalize(key.reshape(num_tokens, -1, module.head_k_dim).to(dtype))
    query = query * module.head_k_dim ** -0.5
    value = value.reshape(num_tokens, -1, module.head_v_dim).to(dtype)
    if module.num_v_heads != module.num_k_heads:
        repeat = module.num_v_heads // module.num_k_heads
        # each query/key head serves `repeat` consecutive value heads
        query, key = (x[:, :, None].expand(num_tokens, module.num_k_heads, repeat, module.head_k_dim)
                      .reshape(num_tokens, module.num_v_heads, module.head_k_dim) for x in (query, key))
    # Single-token continuations take the recurrence itself, the rest the chunked
    # rule, so a decode request in a step with a long prompt is not padded to a chunk.
    return scan_split(
        cu_seqlens, has_initial_state, states["recurrent"], (query, key, value, g, beta),
        decode=lambda state, q, k, v, g_, b: gated_delta_rule_step(q, k, v, g_, b, state)[0],
        chunk=lambda initial, cu, q, k, v, g_, b: chunk_gated_delta_rule_varlen(q, k, v, g_, b, cu, initial))


def input_projections(module: torch.nn.Module, hidden_states: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q|k|v [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]) by the module's own projections."""
    num_tokens = hidden_states.shape[0]
    first = getattr(module, "in_proj_qkvz", None) or getattr(module, "in_proj_qkv", None)
    if isinstance(first, PackedInputProjections):  # all four as one packed matmul (CPU path)
        mixed, z, b, a = first.project(hidden_states)
        return mixed, z.view(num_tokens, -1, cast(GatedDeltaNetModule, module).head_v_dim), b, a
    if hasattr(module, "in_proj_qkvz"):
        fused = cast(_FusedInputProjections, module)
        query, key, value, z, b, a = fused.fix_query_key_value_ordering(
            fused.in_proj_qkvz(hidden_states[None]), fused.in_proj_ba(hidden_states[None]))
        mixed = torch.cat([x.reshape(num_tokens, -1) for x in (query, key, value)], dim=-1)
        return mixed, z[0], b[0], a[0]
    separate = cast(_SeparateInputProjections, module)
    z = separate.in_proj_z(hidden_states).reshape(num_tokens, -1, separate.head_v_dim)
    return (separate.in_proj_qkv(hidden_states), z, separate.in_proj_b(hidden_states),
            separate.in_proj_a(hidden_states))


GATED_DELTA_NET = register_kind(
    GatedDeltaNetKind(),
    ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "LaraMiniGatedDeltaNet",
     "Qwen4ExpTextGatedDeltaNet"),
    model_types=("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "lara_mini", "qwen4_exp",
                 "qwen4_exp_text"),
    layer_types=("linear_attention",))
