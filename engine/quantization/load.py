"""Loading a quantized (or to-be-quantized) checkpoint without transformers' quantizer.

transformers would dequantize FP8 to the load dtype and needs optimum/gptqmodel for
GPTQ, so the engine reads such checkpoints itself:

1. ``load_quantized_model`` builds the model skeleton from the config with its
   ``quantization_config`` dropped, parameters on the meta device and buffers on the
   target device (accelerate's ``init_empty_weights``); reads every tensor that is not
   part of a quantized linear from the safetensors files (cast to the model dtype);
   hands the experts to ``replace_quantized_experts``; ties the tied weights; and
   refuses a parameter the checkpoint does not hold. The quantized linears' weights
   stay on the meta device: no float copy of them is ever made.
2. The preparation step ``quantized_linears`` (engine/surgery.py's
   PREPARATION_ORDER) puts a QuantizedLinear in place of each of them, read from the
   checkpoint in its own layout (engine/quantization/formats.py) or, for online
   quantization, quantized from its float weight (engine/quantization/online.py).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn

from ..surgery import replace, submodule
from .checkpoint import CheckpointTensors, QuantizedCheckpointError
from .experts import experts_modules, replace_quantized_experts
from .formats import check_weight_shape, read_quantized_linear, stored_quantized
from .online import quantize_linear
from .scheme import QuantScheme

logger = logging.getLogger(__name__)


# Given the model skeleton, the checkpoint's tensors and the parameters other readers
# fill: the names of float parameters to leave on the meta device.
Deferral = Callable[[nn.Module, CheckpointTensors, set[str]], Collection[str]]


@dataclass
class QuantizedWeights:
    """What the loader leaves for the ``quantized_linears`` preparation step: the
    scheme, the checkpoint's tensors and the names of the linears still to be put in
    place (their weights on the meta device until then)."""

    scheme: QuantScheme
    tensors: CheckpointTensors
    linears: tuple[str, ...]
    dtype: torch.dtype
    # The MoE experts left on the meta device for a tensor-parallel rank, which reads its
    # shares of them (engine/parallel/quantized_slices.py).
    experts_deferred: bool = False


def checkpoint_directory(model: str, revision: str | None) -> Path:
    """The local directory of ``model``: itself, or the hub snapshot of its config and
    safetensors files."""
    if os.path.isdir(model):
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision, allow_patterns=["*.json", "*.safetensors"]))


def load_quantized_model(auto_class: type, hf_config: transformers.PretrainedConfig, directory: Path,
                         scheme: QuantScheme, dtype: torch.dtype, device: torch.device,
                         attn_implementation: str, read_experts: bool = True,
                         defer: Deferral | None = None) -> tuple[nn.Module, QuantizedWeights]:
    """The model of ``directory`` with every tensor but the quantized linears' read, and
    what the ``quantized_linears`` step needs to put those in place (module docstring).
    ``read_experts`` False: the MoE experts stay on the meta device (``experts_deferred``).
    ``defer``: names the float parameters left on the meta device too (a tensor-parallel
    rank reads its slices of them after the split)."""
    from accelerate import init_empty_weights

    config = copy.deepcopy(hf_config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device(device), init_empty_weights(include_buffers=False):
        model = auto_class.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    if hasattr(hf_config, "quantization_config"):
        # Built without transformers' quantizer, but the model's config still says it is
        # quantized: what reads it after (the attention adapters' choice of latent
        # caching) must agree with the cache plan, which reads the checkpoint's config.
        model.config.quantization_config = hf_config.quantization_config
    tensors = CheckpointTensors(directory, device)
    tensors.rename(checkpoint_renaming(model))
    linears = quantized_linear_names(model, tensors, scheme)
    skipped = {f"{name}.{part}" for name in linears for part in ("weight", "bias")}
    experts = {f"{name}.{leaf}" for name, module in experts_modules(model) for leaf, _ in module.named_parameters()}
    left = set(defer(model, tensors, skipped | experts)) if defer is not None else set()
    state = {name: _as_loaded(tensors.get(name), dtype) for name in _loadable(model) - skipped - left
             if name in tensors}
    model.load_state_dict(state, strict=False, assign=True)
    if read_experts:
        replace_quantized_experts(model, tensors, scheme)
    model.tie_weights()
    deferred = () if read_experts else tuple(f"{name}." for name, _ in experts_modules(model))
    missing = sorted(name for name, param in model.named_parameters()
                     if param.is_meta and name not in skipped | left and not name.startswith(deferred))
    if missing:
        raise QuantizedCheckpointError(
            f"checkpoint {directory} has no tensor {missing[0]!r} ({len(missing) - 1} more parameters of "
            f"{type(model).__name__} missing)")
    logger.info("read %s: %d linears quantized as %s", directory, len(linears), scheme.description)
    return model.eval(), QuantizedWeights(scheme, tensors, tuple(linears), dtype, experts_deferred=not read_experts)


def checkpoint_renaming(model: nn.Module) -> Callable[[str], str]:
    """How transformers renames ``model``'s checkpoint keys at load (its conversion
    mapping's renamings, e.g. Mixtral's block_sparse_moe -> mlp), as one function of a
    stored name. Its converters, which fuse per-expert tensors, are left to
    engine/quantization/experts.py, which reads the experts in their stored layout."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    if not isinstance(model, transformers.PreTrainedModel):
        return lambda name: name
    renamings = [transform for transform in get_model_conversion_mapping(model)
                 if isinstance(transform, WeightRenaming)]
    return lambda name: apply_renamings(name, renamings)


def _loadable(model: nn.Module) -> set[str]:
    """The names of the model's parameters and persistent buffers (its state dict)."""
    return set(model.state_dict(keep_vars=True))


def _as_loaded(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as the model holds it: floats in the model dtype."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def quantized_linear_names(model: nn.Module, tensors: CheckpointTensors, scheme: QuantScheme) -> list[str]:
    """The model's linears the checkpoint stores quantized in ``scheme`` (online: every
    linear but the output embeddings and the ignored ones). A linear the checkpoint's
    ignore list names but stores quantized is refused, as is a packed linear whose
    ``weight_shape`` is not the model's."""
    output = getattr(model, "get_output_embeddings", lambda: None)()
    names = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or module is output:
            continue
        if scheme.online:
            if not ignored(scheme, tensors, name):
                names.append(name)
            continue
        if stored_quantized(tensors, name, scheme):
            if ignored(scheme, tensors, name):
                raise QuantizedCheckpointError(
                    f"{name}: stored quantized, but the quantization_config lists it among the modules left "
                    f"unquantized ({', '.join(scheme.ignore)})")
            if scheme.layout == "packed":
                check_weight_shape(tensors, name, (module.out_features, module.in_features))
            names.append(name)
    return names


def ignored(scheme: QuantScheme, tensors: CheckpointTensors, module_name: str) -> bool:
    """Whether the checkpoint's ignore list names the module, by the model's name or by
    the one the checkpoint stores it under."""
    return scheme.ignores(module_name) or scheme.ignores(tensors.stored_module(module_name))


def put_quantized_linears(model: nn.Module, weights: QuantizedWeights) -> int:
    """The ``quantized_linears`` preparation step: each linear the loader left on the
    meta device replaced by its QuantizedLinear; returns how many."""
    scheme = weights.scheme
    for name in weights.linears:
        linear = submodule(model, name)
        assert isinstance(linear, nn.Linear), f"{name} is {type(linear).__name__}, the loader left a linear"
        shape = (linear.out_features, linear.in_features)
        reader = quantize_linear if scheme.online else read_quantized_linear
        replace(model, name, reader(weights.tensors, name, scheme, shape, weights.dtype))
    weights.tensors.close()
    return len(weights.linears)
