"""Which packed linears run on the small-batch C kernel instead of oneDNN, shape by shape.

oneDNN's packed linear is tuned for many rows: on the few rows of a decode step it is
bound neither by reading the weights nor by arithmetic, and it pads fewer than 16
rows to a bucket. The small-batch kernel (kernels/cpu_small_linear.c) multiplies any
number of rows without padding, its tiles of rows streaming each block of weights
once. Which is faster depends on the weight's shape (whether it stays in the cache,
a vocabulary-wide LM head) and on the host, so each shape is raced once per host
(cached as the other CPU path races are) and the packed weight of that shape is
made for the winner only: one packed copy either way.
"""

from __future__ import annotations

import math

import torch

from ..kernels.cpu_small_linear import pack_small_linear, small_linear, small_linear_available
from .linear import SmallKernelChoice, onednn_linear_available, packed_matmul
from .measurement import measured, race

# The rows raced: decode steps' (1 to 16 sequences) and prefill chunks'. The kernel
# takes a shape where the geometric mean of its speed ratios over these, each row
# count weighing alike, is at least TAKE_RATIO.
RACED_ROWS = (1, 4, 8, 16, 64, 256)
TAKE_RATIO = 1.05
# The raced weight holds at most this many bytes (its outputs cut to fit): past a few
# times the last-level cache, both sides read it from memory alike.
RACED_WEIGHT_BYTES = 64 << 20


def small_linear_capability(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the small-batch kernel runs packed linears of ``dtype`` here, and why."""
    if not small_linear_available(dtype):
        return False, "cpu_small_linear.c does not build here or takes no such dtype (float32 and bfloat16)"
    if not onednn_linear_available(dtype):
        return False, "it replaces oneDNN's packed linear, which does not run this dtype here"
    return True, "raced per linear shape against oneDNN's packed linear"


def small_kernel_choice(rows_hint: int, forced: bool) -> SmallKernelChoice:
    """The choice ``pack_linears`` asks per weight shape: every shape when ``forced``
    (SHARDLINE_CPU_PATHS=small_linear_kernel=on), else each by its cached race."""
    def choose(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
        if forced:
            return True
        key = (str(dtype), out_features, in_features, rows_hint)
        speedup = measured("small_linear", key, lambda: small_linear_speedup(out_features, in_features, dtype,
                                                                              rows_hint))
        return speedup >= TAKE_RATIO

    return choose


@torch.inference_mode()
def small_linear_speedup(out_features: int, in_features: int, dtype: torch.dtype, rows_hint: int) -> float:
    """The geometric mean over RACED_ROWS of how many times faster the small-batch
    kernel multiplies a random [out_features, in_features] weight of ``dtype`` than
    oneDNN's linear packed for ``rows_hint`` rows (as packed_matmul runs it)."""
    generator = torch.Generator().manual_seed(0)
    outputs = max(1, min(out_features, RACED_WEIGHT_BYTES // (in_features * dtype.itemsize)))
    weight = torch.randn(outputs, in_features, generator=generator).to(dtype)
    ours, onednn = pack_small_linear(weight), torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
    inputs = [torch.randn(rows, in_features, generator=generator).to(dtype) for rows in RACED_ROWS]
    ratios = [race(lambda x=x: packed_matmul(x, onednn, None), lambda x=x: small_linear(x, ours, None))
              for x in inputs]  # our time over oneDNN's, per row count
    return math.exp(-sum(map(math.log, ratios)) / len(ratios))
