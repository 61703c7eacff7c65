"""Quantized MoE experts: a checkpoint's expert tensors put in place kept quantized.

``replace_quantized_experts`` is the loader's one call for a model's experts (called
after the dense linears are read, engine/quantization/load.py): it returns how many
expert modules it replaced. Until expert kernels land, a checkpoint whose experts are
stored quantized is refused with one line naming the format and a tensor.
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .checkpoint import CheckpointTensors
from .scheme import QuantScheme

# Name endings of the tensors a quantized expert is stored as (MXFP4's _blocks/_scales,
# FP8's scales, GPTQ/AWQ's and compressed-tensors' packed weights).
QUANTIZED_SUFFIXES = ("_blocks", "_scales", ".weight_scale", ".weight_scale_inv", ".qweight", ".qzeros",
                      ".weight_packed", ".scales")


def quantized_expert_tensors(tensors: CheckpointTensors) -> list[str]:
    """The checkpoint's tensors that belong to quantized MoE experts, sorted."""
    return sorted(name for name in tensors.names()
                  if ".experts." in name and name.endswith(QUANTIZED_SUFFIXES))


def replace_quantized_experts(model: nn.Module, tensors: CheckpointTensors, scheme: QuantScheme) -> int:
    """Put the model's quantized experts in place from ``tensors``; return how many
    expert modules were replaced (0 when the checkpoint stores no quantized experts).
    UnsupportedModelError where it does, naming the format and one tensor."""
    del model  # read once expert kernels land
    found = quantized_expert_tensors(tensors)
    if not found:
        return 0
    raise UnsupportedModelError(
        f"MoE experts quantized as {scheme.description} ({found[0]} and {len(found) - 1} more tensors) are not "
        "run by shardline yet; vLLM runs them")
