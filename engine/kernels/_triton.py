"""Guarded Triton import and dtype checks shared by the kernel launchers.

Triton is optional: ``import shardline.engine.kernels`` must work on machines without
it (the plain-torch references still run); the launchers raise when it is missing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from triton.runtime.jit import KernelInterface

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: references work, launchers raise
    triton = None
    tl = None

# The kernels accumulate in float32; float64 would silently lose precision, so the
# launchers reject it and the torch attention path serves float64 instead.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_available() -> bool:
    """True when Triton can be imported, so the launchers can run."""
    return triton is not None


def interpreter_active() -> bool:
    """True when kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def launcher(kernel: KernelInterface[Any], grid: tuple[int, ...]) -> Callable[..., object]:
    """``kernel[grid]``, the callable that launches ``kernel`` over ``grid``, typed as what
    a launch accepts. Triton types it as the kernel's Python signature, whose compile-time
    parameters are annotated ``tl.constexpr`` while a launch passes them plain ints, bools
    and dtypes, and takes launch options (``num_warps``) besides."""
    return kernel[grid]


def require_triton() -> None:
    if triton is None:
        raise RuntimeError(
            "Triton is not installed; install triton or use the torch attention path"
        )


def check_kernel_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in KERNEL_DTYPES:
        accepted = ", ".join(str(dtype) for dtype in KERNEL_DTYPES)
        raise TypeError(
            f"{name} has dtype {tensor.dtype}; the Triton kernels accept {accepted} "
            "(use the torch path for other dtypes)"
        )


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
