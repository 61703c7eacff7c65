"""At which row counts a packed linear runs on the small-batch C kernel instead of oneDNN.

oneDNN's packed linear is tuned for many rows: on the few rows of a decode step it is
bound neither by reading the weights nor by arithmetic, and it pads fewer than 16
rows to a bucket. The small-batch kernel (kernels/cpu_small_linear.c) reads oneDNN's
own packed copy where its layout allows (engine/cpu/linear.py's KernelPacked) and
multiplies any number of rows without padding, its tiles of rows streaming each
block of weights once. Which is faster depends on the weight's shape, the row count,
the host, and where the weights come from: a step runs every linear of the model
once, so between two runs of one linear it reads all the others, and a model whose
linear weights outgrow the last-level cache reads each from memory. A race that
runs one weight again and again reads it from the cache instead, where the kernel's
arithmetic, not its streaming, decides: it would take row counts that run slower in
the step. So each shape is raced over copies of its weight run one after the other,
as many as the model's linear weights fill (up to RACED_BYTES), at each of
KERNEL_ROW_COUNTS, once per host (cached as the other CPU path races are).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels.cpu_small_linear import SmallLinearWeight, onednn_view, small_linear, small_linear_available
from .linear import KERNEL_ROW_COUNTS, SmallKernelChoice, onednn_linear_available, packed_matmul
from .measurement import measured, race

# The kernel takes a row count where it measures at least this much faster: a race
# of one shape alone misses some of what a step's mix of shapes and other work does
# to the memory traffic, and at 16 rows a 1.05-1.15x race ran slower in the step.
TAKE_RATIO = 1.15
# From this many rows both sides are bound by their arithmetic, which a race of one
# shape measures as a step runs it: a smaller margin holds there (a row count taken
# at 1.03-1.15x ran faster in the step, not slower).
ARITHMETIC_TAKE_ROWS = 32
ARITHMETIC_TAKE_RATIO = 1.03
# Past the row counts a decode step's few rows bind by reading the weights, arithmetic
# binds both sides: from the first of these the kernel measures slower at, larger
# counts stay on oneDNN unraced (racing them costs the most).
ARITHMETIC_ROWS = 8
# The raced weight holds at most this many bytes (its outputs cut to fit).
RACED_WEIGHT_BYTES = 64 << 20
# The raced copies hold at most this many bytes: past a few times the last-level
# cache, each copy is read from memory as a step reads a large model's weights.
RACED_BYTES = 128 << 20
# Rounds of each race, each side's best compared: a loaded machine slows either side
# at random, and with few rounds the row counts a shape takes moved between processes.
RACE_ROUNDS = 5


def small_linear_capability(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the small-batch kernel runs packed linears of ``dtype`` here, and why."""
    if not small_linear_available(dtype):
        return False, "cpu_small_linear.c does not build here or takes no such dtype (float32 and bfloat16)"
    if not onednn_linear_available(dtype):
        return False, "it reads oneDNN's packed linears, which do not run this dtype here"
    return True, "raced per linear shape and row count against oneDNN's packed linear, as a step reads the weights"


def linear_weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``model``'s CPU nn.Linear weights packed in ``dtype``: what a step reads
    between two runs of one linear."""
    return sum(module.weight.numel() * dtype.itemsize for module in model.modules()
               if isinstance(module, torch.nn.Linear) and module.weight.device.type == "cpu")


def small_kernel_choice(rows_hint: int, forced: bool, step_bytes: int = 0) -> SmallKernelChoice:
    """The choice ``pack_linears`` asks per weight shape: every row count when
    ``forced``, else those whose cached race the kernel won, raced over copies of the
    weight filling ``step_bytes`` (the model's linear weights, ``linear_weight_bytes``)."""
    def choose(out_features: int, in_features: int, dtype: torch.dtype) -> frozenset[int]:
        if forced:
            return frozenset(KERNEL_ROW_COUNTS)
        copies = raced_copies(out_features, in_features, dtype, step_bytes)
        # Built on the first row count whose race is not cached.
        raced = functools.cache(lambda: RacedWeights.build(out_features, in_features, dtype, rows_hint, copies))

        def speedup_at(rows: int) -> float:
            def measure() -> float:  # 0 where the kernel cannot read oneDNN's layout
                weights = raced()
                return 0.0 if weights is None else weights.speedup(rows)

            key = (str(dtype), out_features, in_features, rows_hint, rows, copies, RACE_ROUNDS)
            return measured("small_linear", key, measure)

        return rows_taken(speedup_at)

    return choose


def rows_taken(speedup_at: Callable[[int], float]) -> frozenset[int]:
    """The row counts of KERNEL_ROW_COUNTS the kernel takes, given how many times
    faster than oneDNN it runs each (asked in increasing order, and not past the first
    of ARITHMETIC_ROWS or more it runs slower at): those it wins by TAKE_RATIO, or
    from ARITHMETIC_TAKE_ROWS rows by ARITHMETIC_TAKE_RATIO."""
    taken = set()
    for rows in KERNEL_ROW_COUNTS:
        speedup = speedup_at(rows)
        if speedup >= (ARITHMETIC_TAKE_RATIO if rows >= ARITHMETIC_TAKE_ROWS else TAKE_RATIO):
            taken.add(rows)
        elif rows >= ARITHMETIC_ROWS and speedup < 1:
            break
    return frozenset(taken)


def raced_copies(out_features: int, in_features: int, dtype: torch.dtype, step_bytes: int) -> int:
    """How many copies of the raced weight run one after the other: enough to fill
    ``step_bytes``, at most RACED_BYTES."""
    weight_bytes = raced_outputs(out_features, in_features, dtype) * in_features * dtype.itemsize
    return max(1, min(step_bytes, RACED_BYTES) // weight_bytes)


def raced_outputs(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    return max(1, min(out_features, RACED_WEIGHT_BYTES // (in_features * dtype.itemsize)))


@dataclass(frozen=True)
class RacedWeights:
    """Copies of one random weight packed by oneDNN, and the kernel's views of them."""

    onednn: list[torch.Tensor]
    kernel: list[SmallLinearWeight]

    @classmethod
    def build(cls, out_features: int, in_features: int, dtype: torch.dtype, rows_hint: int,
              copies: int) -> RacedWeights | None:
        """``copies`` random [out_features (cut to RACED_WEIGHT_BYTES), in_features]
        weights of ``dtype`` packed for ``rows_hint`` rows; None where the kernel cannot
        read oneDNN's layout of them."""
        generator = torch.Generator().manual_seed(0)
        outputs = raced_outputs(out_features, in_features, dtype)
        weight = torch.randn(outputs, in_features, generator=generator).to(dtype)
        packed = [torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint) for _ in range(copies)]
        view = onednn_view(packed[0], weight)
        # Every copy is packed alike: the first one's layout holds for each.
        return None if view is None else cls(packed, [dataclasses.replace(view, storage=copy) for copy in packed])

    @torch.inference_mode()
    def speedup(self, rows: int) -> float:
        """How many times faster the kernel multiplies ``rows`` random rows by every
        copy, one after the other, than oneDNN does (as packed_matmul runs it)."""
        x = torch.randn(rows, self.kernel[0].in_features, generator=torch.Generator().manual_seed(rows))
        x = x.to(self.kernel[0].dtype)

        def onednn() -> None:
            for copy in self.onednn:
                packed_matmul(x, copy, None)

        def kernel() -> None:
            for copy in self.kernel:
                small_linear(x, copy, None)

        return 1 / race(onednn, kernel, rounds=RACE_ROUNDS)
