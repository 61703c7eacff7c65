"""At which row counts a packed linear runs on the small-batch C kernel instead of oneDNN.

oneDNN's packed linear is tuned for many rows: on the few rows of a decode step it is
bound neither by reading the weights nor by arithmetic, and it pads fewer than 16
rows to a bucket. The small-batch kernel (kernels/cpu_small_linear.c) reads oneDNN's
own packed copy where its layout allows (engine/cpu/linear.py's KernelPacked) and
multiplies any number of rows without padding, its tiles of rows streaming each
block of weights once. Which is faster depends on the weight's shape (whether it
stays in the cache, a vocabulary-wide LM head), the row count and the host, so each
shape is raced at each of KERNEL_ROW_COUNTS once per host (cached as the other CPU
path races are).
"""

from __future__ import annotations

import torch

from ..kernels.cpu_small_linear import onednn_view, small_linear, small_linear_available
from .linear import KERNEL_ROW_COUNTS, SmallKernelChoice, onednn_linear_available, packed_matmul
from .measurement import measured, race

# The kernel takes a row count where it measures at least this much faster.
TAKE_RATIO = 1.05
# The raced weight holds at most this many bytes (its outputs cut to fit): past a few
# times the last-level cache, both sides read it from memory alike.
RACED_WEIGHT_BYTES = 64 << 20


def small_linear_capability(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the small-batch kernel runs packed linears of ``dtype`` here, and why."""
    if not small_linear_available(dtype):
        return False, "cpu_small_linear.c does not build here or takes no such dtype (float32 and bfloat16)"
    if not onednn_linear_available(dtype):
        return False, "it reads oneDNN's packed linears, which do not run this dtype here"
    return True, "raced per linear shape and row count against oneDNN's packed linear"


def small_kernel_choice(rows_hint: int, forced: bool) -> SmallKernelChoice:
    """The choice ``pack_linears`` asks per weight shape: every row count when
    ``forced``, else those whose cached race the kernel won."""
    def choose(out_features: int, in_features: int, dtype: torch.dtype) -> frozenset[int]:
        if forced:
            return frozenset(KERNEL_ROW_COUNTS)
        taken = set()
        for rows in KERNEL_ROW_COUNTS:
            key = (str(dtype), out_features, in_features, rows_hint, rows)
            speedup = measured("small_linear", key, lambda rows=rows: small_linear_speedup(
                out_features, in_features, dtype, rows_hint, rows))
            if speedup >= TAKE_RATIO:
                taken.add(rows)
        return frozenset(taken)

    return choose


@torch.inference_mode()
def small_linear_speedup(out_features: int, in_features: int, dtype: torch.dtype, rows_hint: int,
                         rows: int) -> float:
    """How many times faster the small-batch kernel multiplies ``rows`` rows by a random
    [out_features, in_features] weight of ``dtype`` packed by oneDNN for ``rows_hint``
    rows than oneDNN does (as packed_matmul runs it); 0 where the kernel cannot read
    oneDNN's layout of it."""
    generator = torch.Generator().manual_seed(0)
    outputs = max(1, min(out_features, RACED_WEIGHT_BYTES // (in_features * dtype.itemsize)))
    weight = torch.randn(outputs, in_features, generator=generator).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
    view = onednn_view(packed, weight)
    if view is None:
        return 0.0
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    return 1 / race(lambda: packed_matmul(x, packed, None), lambda: small_linear(x, view, None))
