"""CPU fast paths for hybrid models' layers, beside layers.py's Llama-family ones.

paths.py's ``optimize_for_cpu`` packs every linear (the recurrent
mixers' projections among them) and fuses gated MLPs; its fused norms and decoder
layers take the Llama family's forms. A hybrid (Qwen3.5, Qwen3-Next, ...) keeps its
own decoder layers, whose norms are zero-centred (``(1 + weight) * x / rms(x)``), and
its gated delta-net layers end with a gated norm (``weight * x / rms(x) * silu(z)``).
``optimize_hybrid_layers`` replaces, in a model with recurrent layers:

- each zero-centred RMSNorm by a FusedRMSNorm over ``1 + weight``, and each gated norm
  by one that normalises through the same kernel, where either reproduces the
  module's output on a probe input;
- each gated delta-net layer's input projections (Qwen3.5's in_proj_qkv, in_proj_z,
  in_proj_b and in_proj_a; Qwen3-Next's in_proj_qkvz and in_proj_ba) by one matmul
  over their weights packed side by side, the rows ordered as the layer reads them
  (q|k|v as the convolution takes them, then z, b and a), so a step reads the hidden
  states once and makes one call where it made four (two of them 8 columns wide);
- the decoder layers by FusedHybridDecoderLayers (engine/cpu/hybrid_decoder.py);
- where the last decoder layer is not one, its MLP by one that runs at the rows the
  step samples alone when the runner marks them (``AttentionContext.sampled_rows``, prefill steps): the
  final norm and the LM head read nothing else of that layer's output, and an MLP is
  a function of each row alone. Its other rows are left at the layer's residual
  (the load check compares the sampled rows only there, as for FusedDecoderLayer).

Each replacement falls back to the original module with gradients on or another dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu_fused import fused_kernels_available, rms_norm
from ..recurrent.base import projection_out_features
from ..recurrent.gated_delta_net import (
    GatedDeltaNetKind,
    GatedDeltaNetModule,
    PackedInputProjections,
    StridedGateNorm,
    input_projections,
)
from ..recurrent.state import RecurrentLayer, StepHolder
from ..surgery import decoder_layers, replace
from .hybrid_decoder import FusedHybridDecoderLayer, fuse_hybrid_decoder_layers
from .layers import FusedDecoderLayer
from .linear import FusedGatedMLP, packable_side_by_side, packed_matmul
from .norms import FUSED_DTYPES, FusedRMSNorm, norm_epsilon, same_output

logger = logging.getLogger(__name__)


class _ReorderedProjections(Protocol):
    """Qwen3-Next's input projections (q|k|v|z and b|a), which its module reorders."""

    in_proj_qkvz: nn.Module
    in_proj_ba: nn.Module

    def fix_query_key_value_ordering(self, mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor
                                     ) -> tuple[torch.Tensor, ...]: ...


def norm_weight(norm: nn.Module) -> torch.Tensor:
    """A norm's ``weight`` tensor (checked where a fused norm is built)."""
    weight = norm.weight
    assert isinstance(weight, torch.Tensor), f"{type(norm).__name__}.weight is not a tensor"
    return weight


class FusedOffsetRMSNorm(FusedRMSNorm):
    """A zero-centred RMSNorm, ``(1 + weight) * x / rms(x)``, through the fused kernel."""

    scale: torch.Tensor  # 1 + the norm's weight, a buffer

    def __init__(self, norm: nn.Module) -> None:
        super().__init__(norm)
        self.register_buffer("scale", 1 + norm_weight(norm).detach(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.scale


class FusedGatedRMSNorm(StridedGateNorm):
    """``weight * x / rms(x) * silu(z)`` (the gated delta-net's output norm) with the
    normalisation through the fused kernel; ``norm`` is the original module."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        eps = norm_epsilon(norm)
        assert eps is not None, f"{type(norm).__name__} has no epsilon"
        self.norm = norm
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [rows, D] -> [rows, D]
        weight = norm_weight(self.norm)
        if x.dtype != weight.dtype or gate.dtype != weight.dtype or torch.is_grad_enabled():
            return self.norm(x, gate)
        rows = x.reshape(-1, x.shape[-1])
        normed = rms_norm(rows if rows.stride(-1) == 1 else rows.contiguous(), weight, self.eps)
        # gate: any layout of x's numel (a strided view of a packed projection's output).
        # The models' rounding: weight * normed in x's dtype (the kernel's), then silu of
        # the gate and the product in float32, rounded to x's dtype once.
        if normed.dtype == torch.float32:
            return F.silu(gate).reshape(normed.shape).mul_(normed).view(x.shape)
        return F.silu(gate.float()).reshape(normed.shape).mul_(normed).to(x.dtype).view(x.shape)


class SampledRowsMLP(nn.Module):
    """The last decoder layer's MLP at the step's sampled rows alone when the runner
    marks them (zeros elsewhere: the layer adds them to its residual, which nothing
    reads); ``mlp`` is the original module, which runs every other step."""

    def __init__(self, mlp: nn.Module, holder: StepHolder) -> None:
        super().__init__()
        self.mlp = mlp
        self.holder = holder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden] -> [..., hidden]
        ctx = self.holder.ctx
        rows = None if ctx is None else ctx.sampled_rows
        flat = x.reshape(-1, x.shape[-1])
        if rows is None or rows.numel() >= flat.shape[0]:
            return self.mlp(x)
        out = torch.zeros_like(flat)
        if rows.numel():
            out.index_copy_(0, rows, self.mlp(flat.index_select(0, rows)))
        return out.view(x.shape)


class GatedDeltaNetProjections(nn.Linear, PackedInputProjections):
    """A gated delta-net layer's first input projection (in_proj_qkv, or Qwen3-Next's
    in_proj_qkvz), whose ``project`` runs all of the layer's input projections as one
    packed matmul: (q|k|v [T, conv_dim], z [T, Hv * Dv], b [T, Hv], a [T, Hv]), views of
    its output. Called as a module it is the projection it replaces (torch's linear on
    the same parameters: the layer's own forward, which the load check runs)."""

    def __init__(self, linear: nn.Linear, packed_weight: torch.Tensor, packed_bias: torch.Tensor | None,
                 sizes: list[int]) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same parameters
        self.register_parameter("bias", linear.bias)
        self.packed_weight, self.packed_bias, self.sizes = packed_weight, packed_bias, sizes

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # x: [T, hidden]
        return packed_matmul(x, self.packed_weight, self.packed_bias).split(self.sizes, dim=-1)


def _projection_rows(module: nn.Module) -> tuple[tuple[str, ...], list[torch.Tensor], list[int]] | None:
    """The layer's input projections by name, for each the order of its output rows in
    the packed matmul, and the output sizes (q|k|v, z, b, a); None for a layer
    without Qwen3.5's or Qwen3-Next's projections."""
    layer = cast(GatedDeltaNetModule, module)  # a gated delta-net layer (its kind's module)
    conv_dim, value_dim, heads = 2 * layer.key_dim + layer.value_dim, layer.value_dim, layer.num_v_heads
    sizes = [conv_dim, value_dim, heads, heads]
    if all(hasattr(module, name) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        return names, [torch.arange(projection_out_features(getattr(module, name))) for name in names], sizes
    if hasattr(module, "in_proj_qkvz") and hasattr(module, "in_proj_ba"):
        reordered = cast(_ReorderedProjections, module)
        # The layer's own reordering, applied to row numbers, says which row lands where.
        qkvz_rows = torch.arange(projection_out_features(reordered.in_proj_qkvz), dtype=torch.float64)[None, None]
        ba_rows = torch.arange(projection_out_features(reordered.in_proj_ba), dtype=torch.float64)[None, None]
        query, key, value, z, b, a = reordered.fix_query_key_value_ordering(qkvz_rows, ba_rows)
        order = [torch.cat([x.reshape(-1) for x in group]).long() for group in ((query, key, value, z), (b, a))]
        return ("in_proj_qkvz", "in_proj_ba"), order, sizes
    return None


def pack_gated_delta_net_projections(model: nn.Module, rows_hint: int) -> int:
    """Replace each gated delta-net layer's first input projection by a
    GatedDeltaNetProjections over all of its packed input projections (see the module
    docstring) where they are packed linears of one dtype; returns how many layers."""
    num_packed = 0
    for layer_name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, RecurrentLayer)]:
        module = layer.layer
        if type(layer.kind) is not GatedDeltaNetKind:  # a variant projects its own way
            continue
        found = _projection_rows(module)
        if found is None:
            continue
        names, orders, sizes = found
        linears = tuple(getattr(module, name) for name in names)
        if not packable_side_by_side(linears):
            continue
        packed_dtype = linears[0].packed_weight.dtype
        weight = torch.cat([linear.weight.detach()[order] for linear, order in zip(linears, orders)])
        bias = None if linears[0].bias is None else torch.cat(
            [linear.bias.detach()[order] for linear, order in zip(linears, orders)]).to(packed_dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(packed_dtype), rows_hint)
        joint = GatedDeltaNetProjections(linears[0], packed, bias, sizes)
        probe = _probe(linears[0].in_features, linears[0].weight.dtype)  # the layer's hidden size
        with torch.no_grad():
            expected = input_projections(module, probe)
            for name, linear in zip(names, linears):  # their own packed copies are no longer read
                replace(model, f"{layer_name}.layer.{name}", joint if name == names[0] else linear.unpacked())
            actual = input_projections(module, probe)
            same = all(same_output(got, wanted) for got, wanted in zip(actual, expected))
        if not same:
            for name, linear in zip(names, linears):
                replace(model, f"{layer_name}.layer.{name}", linear)
            logger.info("%s's packed input projections differ from its own; it keeps them apart",
                        type(module).__name__)
            continue
        num_packed += 1
    return num_packed


def _is_zero_centred_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and not isinstance(module, FusedRMSNorm)
            and isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.device.type == "cpu"
            and weight.dtype in FUSED_DTYPES and norm_epsilon(module) is not None)


def _is_gated_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNormGated") and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and weight.device.type == "cpu" and weight.dtype in FUSED_DTYPES
            and norm_epsilon(module) is not None)


def _probe(size: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(5, size, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def fuse_hybrid_norms(model: nn.Module) -> int:
    """Replace zero-centred and gated RMSNorms by fused ones where they reproduce the
    module's output on a probe (see the module docstring); returns how many."""
    num_fused = 0
    for name, module in list(model.named_modules()):
        gated = _is_gated_norm(module)
        if not (gated or _is_zero_centred_norm(module)):
            continue
        weight = norm_weight(module)
        if not fused_kernels_available(weight.dtype):
            continue
        x = _probe(weight.shape[0], weight.dtype)
        with torch.no_grad():
            if gated:
                gate = _probe(weight.shape[0], weight.dtype, seed=1)
                fused = FusedGatedRMSNorm(module)
                same = same_output(fused(x, gate), module(x, gate))
            else:
                fused = FusedOffsetRMSNorm(module)
                same = same_output(fused(x), module(x))
        if same:
            replace(model, name, fused)
            num_fused += 1
        else:
            logger.info("%s is neither (1 + weight) * x / rms(x) nor a gated weight * x / rms(x) * silu(z); "
                        "it keeps its own forward", type(module).__name__)
    return num_fused


def sample_last_mlp(model: nn.Module) -> int:
    """Replace the last decoder layer's MLP by a SampledRowsMLP where it is a gated MLP
    (a function of each row alone); returns how many were replaced (0 or 1)."""
    layers_name, layers = decoder_layers(model)
    if not layers or isinstance(layers[-1], (FusedDecoderLayer, FusedHybridDecoderLayer)):
        return 0  # those run their sampled rows themselves
    last = layers[-1]
    mlp = getattr(last, "mlp", None)
    if not isinstance(mlp, nn.Module) or not (isinstance(mlp, FusedGatedMLP) or all(
            isinstance(getattr(mlp, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj"))):
        return 0
    holder = StepHolder()
    replace(model, ".".join(filter(None, (layers_name, str(len(layers) - 1), "mlp"))), SampledRowsMLP(mlp, holder))
    model.register_forward_pre_hook(holder.hold, with_kwargs=True)
    model.register_forward_hook(holder.release, always_call=True)
    return 1


@dataclass(frozen=True)
class HybridRewrites:
    """How many modules ``optimize_hybrid_layers`` replaced: norms, decoder layers and
    the others (packed projections, the last MLP at the sampled rows)."""

    norms: int = 0
    layers: int = 0
    others: int = 0


def optimize_hybrid_layers(model: nn.Module, fused_kernels: bool, rows_hint: int) -> HybridRewrites:
    """The hybrid rewrites of the module docstring for a model with recurrent layers
    (none for any other); ``fused_kernels``: whether the engine took the fused kernels;
    ``rows_hint``: the row count oneDNN tunes packed weights for (engine/cpu/linear.py)."""
    if not any(isinstance(module, RecurrentLayer) for module in model.modules()):
        return HybridRewrites()
    projections = pack_gated_delta_net_projections(model, rows_hint)
    norms = fuse_hybrid_norms(model) if fused_kernels else 0
    layers = fuse_hybrid_decoder_layers(model, rows_hint) if fused_kernels else 0
    return HybridRewrites(norms, layers, projections + sample_last_mlp(model))
