"""The row counts oneDNN's packed linears are called with (engine/cpu/linear.py's
packed linears and the quantized prefill panels of kernels/cpu_quant_panel.py).

oneDNN builds and caches a kernel per distinct row count (about 0.6 MB each, up to
its cache's 1024 entries per layer shape), and a continuous batch sees almost every
row count between 1 and its token budget: the cache would grow with the run. Rows
are padded with zeros to a bucket instead (FEW_ROWS, then its doubles up to SMALL_ROWS,
multiples of SMALL_ROWS up to LARGE_ROWS), and more than LARGE_ROWS rows run as two
calls, their largest multiple of LARGE_ROWS and the rest in its bucket (``row_parts``),
so each layer shape meets at most a few dozen row counts and a step pads fewer than
SMALL_ROWS rows. oneDNN's float32 rows do not depend on the other rows of the call
(tests/engine/cpu/test_cpu_linear.py checks it where it holds on the host), so the split
changes no row's product there. Few decode rows keep buckets of their own: oneDNN's
float32 linear is not bound by reading the weights there, so padding 4 rows to 16 would
lengthen a decode step's linears, while 1 and 2 rows run no faster than 4.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FEW_ROWS = 4
SMALL_ROWS = 16
LARGE_ROWS = 256


def row_bucket(rows: int) -> int:
    """The padded row count oneDNN sees for one call of ``rows`` rows (see ``row_parts``)."""
    if rows < SMALL_ROWS:
        bucket = FEW_ROWS
        while bucket < rows:
            bucket *= 2
        return bucket
    step = SMALL_ROWS if rows <= LARGE_ROWS else LARGE_ROWS
    return -(-rows // step) * step


def row_parts(rows: int) -> tuple[int, ...]:
    """The row counts of the calls ``rows`` rows run as, in order: one call, or past
    LARGE_ROWS the largest multiple of LARGE_ROWS and the rest."""
    rest = rows % LARGE_ROWS if rows > LARGE_ROWS else 0
    return (rows - rest, rest) if rest else (rows,)


def by_row_parts(flat: torch.Tensor, matmul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``matmul`` over flat [rows, in] as the calls ``row_parts`` gives, their results
    concatenated in order."""
    parts = row_parts(flat.shape[0])
    if len(parts) == 1:
        return matmul(flat)
    return torch.cat([matmul(part) for part in flat.split(parts)])


def padded_rows(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """flat [rows, in] with zero rows added up to ``row_bucket(rows)``, in ``dtype`` (one
    copy; flat itself where it is already both)."""
    rows = flat.shape[0]
    bucket = row_bucket(rows)
    if bucket == rows and flat.dtype == dtype:
        return flat
    padded = flat.new_empty(bucket, flat.shape[1], dtype=dtype)
    padded[:rows] = flat
    padded[rows:].zero_()
    return padded
