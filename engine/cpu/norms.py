"""Fused RMSNorms for the CPU path: a norm whose output kernels/cpu_fused.c reproduces
on a probe input runs as one pass of that kernel (transformers' RMSNorm runs seven
torch ops, each a dispatch and a fresh temporary). Gemma-style norms (``1 + weight``)
fail the probe and stay as they are. ``norm_rows`` and ``add_norm_rows`` are the fused
layers' calls: the norm of 2-D rows, and the residual add fused into the next norm.

float32 and bfloat16 only (``FUSED_DTYPES``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..kernels.cpu_fused import add_rms_norm_, fused_kernels_available, rms_norm, rms_norm_heads
from ..surgery import called_on, replace_if_reproduces, reproduces
from .protocols import WeightedNorm

if TYPE_CHECKING:  # typing.TypeIs is Python 3.13's
    from typing_extensions import TypeIs

FUSED_DTYPES = (torch.float32, torch.bfloat16)


def same_output(actual: object, expected: object) -> bool:
    """Whether a replacement's output reproduces the module's (bfloat16 within its rounding)."""
    return reproduces(actual, expected, bfloat16_tolerance=2e-2)


def norm_epsilon(module: object) -> float | None:
    """A norm's epsilon (``variance_epsilon`` or ``eps``), or None where it has no float one."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def fused_norm_epsilon(norm: nn.Module) -> float:
    """The epsilon of a norm the fused kernel runs (one with a float ``variance_epsilon``
    or ``eps``, as the fused norms' checks require)."""
    eps = norm_epsilon(norm)
    if eps is None:
        raise TypeError(f"{type(norm).__name__} has no float variance_epsilon or eps for the fused kernel")
    return eps


def _has_weight(module: object) -> TypeIs[WeightedNorm]:
    return isinstance(getattr(module, "weight", None), torch.Tensor)


def _is_rms_norm(module: object) -> TypeIs[WeightedNorm]:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and norm_epsilon(module) is not None and weight.device.type == "cpu" and weight.dtype in FUSED_DTYPES)


class FusedRMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` in one pass of the fused kernel; ``norm``
    is the original module, whose forward runs with gradients on or another dtype."""

    norm: WeightedNorm  # registered as a submodule; typed by what is read of it
    eps: float

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        if not _has_weight(norm):
            raise TypeError(f"{type(norm).__name__} has no weight tensor for the fused kernel")
        self.norm = norm
        self.eps = fused_norm_epsilon(norm)

    @property
    def weight(self) -> torch.Tensor:
        return self.norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden] -> [..., hidden]
        if x.dtype != self.weight.dtype or torch.is_grad_enabled():
            return self.norm(x)
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return rms_norm(rows, self.weight, self.eps).view(x.shape)


def fuse_rms_norms(model: nn.Module) -> int:
    """Replace every RMSNorm the fused kernel reproduces by a FusedRMSNorm (see the
    module docstring); returns how many were replaced."""
    modules: list[tuple[str, nn.Module]] = list(model.named_modules())
    targets = [(name, module) for name, module in modules if _is_rms_norm(module)]
    num_fused = 0
    for name, norm in targets:
        if not fused_kernels_available(norm.weight.dtype):
            break
        probe = torch.randn(5, norm.weight.shape[0], generator=torch.Generator().manual_seed(0)) * 3
        num_fused += replace_if_reproduces(model, name, FusedRMSNorm(norm), called_on(probe.to(norm.weight.dtype)),
                                           same_output)
    return num_fused


def norm_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) for 2-D x, through the kernel when the norm was fused."""
    if isinstance(module, FusedRMSNorm):
        return rms_norm(x if x.stride(-1) == 1 else x.contiguous(), module.weight, module.eps)
    return module(x)


def norm_heads(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module over each head of x [T, H, D] (each token's heads contiguous): [T * H, D],
    through the kernel without copying the heads together first when the norm was fused."""
    if isinstance(module, FusedRMSNorm) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return rms_norm_heads(x, module.weight, module.eps)
    return norm_rows(module, x.reshape(-1, x.shape[2]))


def add_norm_rows(module: nn.Module, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """residual += delta in place (both [T, hidden]); returns module(residual)."""
    if isinstance(module, FusedRMSNorm) and residual.stride(1) == 1 and delta.stride(1) == 1:
        return add_rms_norm_(residual, delta, module.weight, module.eps)
    residual.add_(delta)
    return module(residual)
