"""oneDNN matmuls for the CPU path: each nn.Linear runs on a weight packed once.

torch's CPU ``nn.Linear`` calls MKL's sgemm. oneDNN's linear over a weight reordered
once into its blocked layout is faster on the shapes a decoder runs (2-core AVX-512
worker, hidden 512, float32: about 200 GFLOP/s against MKL's 120-140, for 64 to
2048 rows; bench/bench_engine.py prints both peaks). The packed weight is an opaque
oneDNN tensor held beside the module's own weight, which stays untouched for
everything else that reads it (tied embeddings, LoRA, state dicts): on CPU the
linear weights are held twice.

Only float32 and bfloat16 pack (oneDNN has no float64 matmul); float64 keeps
torch's exact-reference path.
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def onednn_linear_available() -> bool:
    """Whether this torch build runs oneDNN's packed linear on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, weight = torch.ones(2, 8), torch.ones(4, 8)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 2)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.equal(out, torch.full((2, 4), 8.0)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def pack_linears(model: nn.Module, rows_hint: int) -> int:
    """Run every CPU nn.Linear of ``model`` in float32 or bfloat16 through oneDNN on a
    packed copy of its weight; returns how many were packed (0 when unavailable).

    ``rows_hint`` is the number of rows oneDNN tunes the packed layout for; any number
    of rows runs on it.
    """
    if not onednn_linear_available():
        logger.info("oneDNN packed linear unavailable; CPU linears run through torch's matmul")
        return 0
    num_packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is not nn.Linear or weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
            continue
        if module.bias is not None and module.bias.dtype != weight.dtype:
            continue
        module.shardline_packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
        module.forward = types.MethodType(_packed_forward, module)
        num_packed += 1
    return num_packed


# oneDNN builds and caches a kernel per distinct row count (about 0.6 MB each, up to
# its cache's 1024 entries per layer shape), and a continuous batch sees almost every
# row count between 1 and its token budget: the cache would grow with the run. Rows
# are padded with zeros to a bucket instead (multiples of SMALL_ROWS up to LARGE_ROWS,
# then multiples of LARGE_ROWS), so each layer shape meets at most a few dozen
# row counts. Padding decode batches costs little (their matmuls are bound by
# reading the weights); a full prefill step is already a multiple of LARGE_ROWS.
SMALL_ROWS = 16
LARGE_ROWS = 256


def row_bucket(rows: int) -> int:
    """The padded row count oneDNN sees for ``rows`` rows."""
    step = SMALL_ROWS if rows <= LARGE_ROWS else LARGE_ROWS
    return -(-rows // step) * step


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # x: [..., in_features] -> [..., out_features]
    # Autograd does not see through the packed weight: with gradients on, use torch's linear.
    if x.dtype != self.weight.dtype or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
        return nn.functional.linear(x, self.weight, self.bias)
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    bucket = row_bucket(rows)
    if bucket != rows:
        flat = torch.cat([flat, flat.new_zeros(bucket - rows, flat.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(flat, self.shardline_packed_weight, self.bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])
