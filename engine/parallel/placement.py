"""A rank's split before its device: the tensor-parallel surgery step on a model the
loader left on the CPU, then the move of this rank's shard to its device.

Why: a model larger than one GPU does not fit one rank's device whole, so each rank
holds it on the CPU (engine/model/loader.py; the split parameters still on the meta
device where engine/parallel/loading.py reads them as slices), keeps its share, and
only that share reaches the device. The attention adapters, installed earlier on the
CPU, keep their originals unregistered (engine/model/adapters/base.py), so the move
takes those originals' own buffers too; the steps after this one run on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from ..quantization.load import QuantizedWeights
from .group import RankGroup
from .loading import RankCheckpoint, read_rank_slices, slice_plan
from .quantized_bounds import refuse_cut_blocks
from .quantized_slices import put_expert_shares, put_linear_shares, put_whole_linears, quantized_share_plan
from .sharding import shard_model

logger = logging.getLogger(__name__)


def place_on_device(model: nn.Module, device: torch.device) -> None:
    """Move ``model`` and its adapters' unregistered originals (their ``original``
    property) to ``device``."""
    model.to(device)
    for module in model.modules():
        if isinstance(getattr(type(module), "original", None), property):  # an adapter's original module
            module.original.to(device)


def shard_then_place(model: nn.Module, group: RankGroup, num_attention_layers: int, device: torch.device,
                     place: Callable[[nn.Module, torch.device], None] = place_on_device,
                     checkpoint: RankCheckpoint | None = None, quantized: QuantizedWeights | None = None) -> int:
    """The tensor-parallel surgery step: ``shard_model``, then (``checkpoint``: the split
    parameters were left on the meta device by engine/parallel/loading.py) this rank's
    slices read into them, then ``place`` this rank's shard on ``device``; return how
    many modules were replaced. ``quantized``: a quantized checkpoint's linears and
    experts, left on the meta device by the loader: experts are read as this rank's shares
    before the split, linears split exactly by slices after it
    (engine/parallel/quantized_slices.py), the others whole before it; its float
    parameters the ranks split are read as ``checkpoint``'s slices. A quantized linear
    whose share would cut a scale block or group is refused before any is read
    (quantized_bounds.py, the pre-flight's line)."""
    if quantized is not None:
        refuse_cut_blocks(model, group, quantized.scheme, quantized.linears)
    plan = slice_plan(model, group) if checkpoint is not None else {}
    shares = quantized_share_plan(model, group, quantized) if quantized is not None else {}
    if quantized is not None:
        whole = put_whole_linears(model, quantized, set(shares))
        logger.info("tensor-parallel rank %d reads %d quantized linears as slices, %d whole", group.rank,
                    len(shares), whole)
        put_expert_shares(model, group, quantized)
    replaced = shard_model(model, group, num_attention_layers)
    if quantized is not None:
        put_linear_shares(model, group, quantized, shares)
    if checkpoint is not None:  # float parameters (a quantized checkpoint's too: its embedding, LM head)
        read_rank_slices(model, checkpoint, plan)
        checkpoint.tensors.close()
    if quantized is not None:
        quantized.tensors.close()
    place(model, device)
    return replaced
