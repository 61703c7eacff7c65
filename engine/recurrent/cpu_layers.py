"""CPU fast paths for hybrid models' layers, beside engine/cpu's Llama-family ones.

engine/cpu/paths.py's ``optimize_for_cpu`` packs every linear (the recurrent
mixers' projections among them) and fuses gated MLPs; its fused norms and decoder
layers take the Llama family's forms. A hybrid (Qwen3.5, Qwen3-Next, ...) keeps its
own decoder layers, whose norms are zero-centred (``(1 + weight) * x / rms(x)``), and
its gated delta-net layers end with a gated norm (``weight * x / rms(x) * silu(z)``).
``optimize_hybrid_layers`` replaces, in a model with recurrent layers:

- each zero-centred RMSNorm by a FusedRMSNorm over ``1 + weight``, and each gated norm
  by one that normalises through the same kernel, where either reproduces the
  module's output on a probe input;
- the last decoder layer's MLP by one that runs at the rows the step samples alone
  when the runner marks them (``AttentionContext.sampled_rows``, prefill steps): the
  final norm and the LM head read nothing else of that layer's output, and an MLP is
  a function of each row alone. Its other rows are left at the layer's residual
  (the load check compares the sampled rows only there, as for FusedDecoderLayer).

Each replacement falls back to the original module with gradients on or another dtype.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu.layers import FUSED_DTYPES, FusedDecoderLayer, FusedRMSNorm
from ..cpu.linear import FusedGatedMLP, replace_module, reproduces
from ..kernels.cpu_fused import fused_kernels_available, rms_norm
from .state import RecurrentLayer, StepHolder

logger = logging.getLogger(__name__)


def _norm_epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _close(actual: object, expected: object) -> bool:
    return reproduces(actual, expected, bfloat16_tolerance=2e-2)


class FusedOffsetRMSNorm(FusedRMSNorm):
    """A zero-centred RMSNorm, ``(1 + weight) * x / rms(x)``, through the fused kernel."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__(norm)
        self.register_buffer("scale", 1 + norm.weight.detach(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.scale


class FusedGatedRMSNorm(nn.Module):
    """``weight * x / rms(x) * silu(z)`` (the gated delta-net's output norm) with the
    normalisation through the fused kernel; ``norm`` is the original module."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.eps = _norm_epsilon(norm)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [rows, D] -> [rows, D]
        weight = self.norm.weight
        if x.dtype != weight.dtype or gate.dtype != weight.dtype or torch.is_grad_enabled():
            return self.norm(x, gate)
        rows = x.reshape(-1, x.shape[-1])
        normed = rms_norm(rows if rows.stride(-1) == 1 else rows.contiguous(), weight, self.eps)
        return F.silu(gate.reshape(normed.shape)).mul_(normed).view(x.shape)


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


def _is_zero_centred_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and not isinstance(module, FusedRMSNorm)
            and isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.device.type == "cpu"
            and weight.dtype in FUSED_DTYPES and _norm_epsilon(module) is not None)


def _is_gated_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNormGated") and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and weight.device.type == "cpu" and weight.dtype in FUSED_DTYPES
            and _norm_epsilon(module) is not None)


def _probe(size: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(5, size, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def fuse_hybrid_norms(model: nn.Module) -> int:
    """Replace zero-centred and gated RMSNorms by fused ones where they reproduce the
    module's output on a probe (see the module docstring); returns how many."""
    num_fused = 0
    for name, module in list(model.named_modules()):
        gated = _is_gated_norm(module)
        if not (gated or _is_zero_centred_norm(module)) or not fused_kernels_available(module.weight.dtype):
            continue
        x = _probe(module.weight.shape[0], module.weight.dtype)
        with torch.no_grad():
            if gated:
                gate = _probe(module.weight.shape[0], module.weight.dtype, seed=1)
                fused = FusedGatedRMSNorm(module)
                same = _close(fused(x, gate), module(x, gate))
            else:
                fused = FusedOffsetRMSNorm(module)
                same = _close(fused(x), module(x))
        if same:
            replace_module(model, name, fused)
            num_fused += 1
        else:
            logger.info("%s is neither (1 + weight) * x / rms(x) nor a gated weight * x / rms(x) * silu(z); "
                        "it keeps its own forward", type(module).__name__)
    return num_fused


def sample_last_mlp(model: nn.Module) -> int:
    """Replace the last decoder layer's MLP by a SampledRowsMLP where it is a gated MLP
    (a function of each row alone); returns how many were replaced (0 or 1)."""
    decoder_layers = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len, default=None)
    if not decoder_layers or isinstance(decoder_layers[-1], FusedDecoderLayer):  # that one has its own
        return 0
    last = decoder_layers[-1]
    mlp = getattr(last, "mlp", None)
    if not (isinstance(mlp, FusedGatedMLP) or all(isinstance(getattr(mlp, name, None), nn.Linear)
                                                   for name in ("gate_proj", "up_proj", "down_proj"))):
        return 0
    holder = StepHolder()
    model.register_forward_pre_hook(holder.hold, with_kwargs=True)
    model.register_forward_hook(holder.release, always_call=True)
    last.mlp = SampledRowsMLP(mlp, holder)
    return 1


def optimize_hybrid_layers(model: nn.Module, fused_kernels: bool) -> int:
    """The hybrid rewrites of the module docstring for a model with recurrent layers
    (none for any other); ``fused_kernels``: whether the engine took the fused kernels.
    Returns how many modules were replaced."""
    if not any(isinstance(module, RecurrentLayer) for module in model.modules()):
        return 0
    return (fuse_hybrid_norms(model) if fused_kernels else 0) + sample_last_mlp(model)
