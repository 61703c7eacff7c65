"""Reading and validating a PEFT-format LoRA adapter directory, without peft.

A directory holds ``adapter_config.json`` and ``adapter_model.safetensors``, whose
tensors are named ``base_model.model.<module>.lora_A.weight`` ([r, in_features])
and ``...lora_B.weight`` ([out_features, r]) for each adapted module. The module
names are the model's own (``model.layers.0.self_attn.q_proj``); the weights, not
``target_modules``, say which modules an adapter changes.

Validation reads only the JSON and the safetensors header (names and shapes), so
the engine can reject a bad adapter when a request is added, before any weight is
loaded. Only plain LoRA is accepted: y = W x + scaling * B (A x), with scaling =
lora_alpha / r, or lora_alpha / sqrt(r) under use_rslora; rank_pattern and
alpha_pattern give per-module r and alpha. Options that change that formula are
rejected by name. GPT-2's Conv1D layers (fan_in_fan_out=true) store their LoRA
weights in the same orientation as nn.Linear's, so they need nothing special.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from .request import LoRAError, LoRARequest

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

_WEIGHT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.lora_(?P<kind>A|B)(?:\.[^.]+)?\.weight$")

# PEFT options that change the math of plain LoRA, with what each must be for us.
_UNSUPPORTED_OPTIONS: dict[str, tuple[str, Any]] = {
    "use_dora": ("DoRA (weight-decomposed LoRA)", False),
    "lora_bias": ("a trained LoRA bias", False),
    "use_qalora": ("QA-LoRA", False),
    "modules_to_save": ("fully trained extra modules (modules_to_save)", None),
    "layer_replication": ("layer replication", None),
    "target_parameters": ("LoRA on raw parameters (target_parameters)", None),
    "trainable_token_indices": ("trainable token embeddings", None),
    "alora_invocation_tokens": ("activated LoRA (alora_invocation_tokens)", None),
}


@dataclass(frozen=True)
class ModuleLoRA:
    """One adapted module: its rank, its scaling and the names of its two tensors."""

    rank: int
    scaling: float
    a_key: str
    b_key: str


@dataclass(frozen=True)
class AdapterSpec:
    """A validated adapter, not yet loaded: what ``load_adapter_weights`` will read."""

    request: LoRARequest
    weights_path: str
    modules: dict[str, ModuleLoRA]

    @property
    def max_rank(self) -> int:
        return max(module.rank for module in self.modules.values())


def inspect_adapter(
    request: LoRARequest, layer_shapes: Mapping[str, tuple[int, int]], max_lora_rank: int
) -> AdapterSpec:
    """Validate ``request``'s adapter against the model's adaptable layers.

    ``layer_shapes`` maps each adaptable module name to (in_features, out_features).
    Raises LoRAError naming the path, the option, the rank or the modules at fault.
    """
    path = request.lora_path
    if not path or not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: lora_path {path!r} is not a local directory")
    config = _read_config(path)
    _check_options(config, path)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        found = ", ".join(sorted(os.listdir(path))) or "nothing"
        raise LoRAError(f"LoRA adapter directory {path!r} has no {ADAPTER_WEIGHTS} (found: {found}); "
                        "only safetensors adapters are supported")
    rank = _positive_int(config.get("r", 8), "r", path)
    if rank > max_lora_rank:
        raise LoRAError(f"LoRA adapter {path!r} has rank r={rank}, above max_lora_rank={max_lora_rank}")
    _check_targets(config.get("target_modules"), layer_shapes, path)
    shapes = _tensor_shapes(weights_path)
    pairs = _pair_keys(shapes, path)
    missing = sorted(set(pairs) - set(layer_shapes))
    if missing:
        raise LoRAError(f"LoRA adapter {path!r} adapts modules that are not adaptable linear layers of this "
                        f"model: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    modules = {}
    for module, (a_key, b_key) in pairs.items():
        module_rank, alpha = _rank_and_alpha(config, module, path)
        _check_shapes(path, module, shapes[a_key], shapes[b_key], module_rank, layer_shapes[module], max_lora_rank)
        scale = alpha / math.sqrt(module_rank) if config.get("use_rslora") else alpha / module_rank
        modules[module] = ModuleLoRA(module_rank, scale, a_key, b_key)
    if not modules:
        raise LoRAError(f"LoRA adapter {path!r} holds no lora_A/lora_B weights")
    return AdapterSpec(request, weights_path, modules)


def load_adapter_weights(
    spec: AdapterSpec, device: torch.device, dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Read the adapter's tensors: module -> (A [r, in], scaling * B [out, r]) on device."""
    try:
        tensors = load_file(spec.weights_path, device="cpu")
    except Exception as exc:  # the file changed or vanished since inspect_adapter read its header
        raise LoRAError(f"cannot load LoRA weights {spec.weights_path!r}: {exc}") from exc
    missing = sorted({key for lora in spec.modules.values() for key in (lora.a_key, lora.b_key)} - set(tensors))
    if missing:
        raise LoRAError(f"LoRA weights {spec.weights_path!r} lost tensors since they were checked: {missing[:4]}")
    weights = {}
    for module, lora in spec.modules.items():
        lora_a = tensors[lora.a_key].to(device=device, dtype=dtype)
        # Scale in float64 before casting, so the scaled B rounds once.
        lora_b = (tensors[lora.b_key].to(torch.float64) * lora.scaling).to(device=device, dtype=dtype)
        weights[module] = (lora_a, lora_b)
    return weights


def _read_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise LoRAError(f"LoRA adapter directory {path!r} has no {ADAPTER_CONFIG}")
    try:
        with open(config_path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise LoRAError(f"cannot read {config_path!r}: {exc}") from exc
    if not isinstance(config, dict):
        raise LoRAError(f"{config_path!r} must hold a JSON object, got {type(config).__name__}")
    return config


def _check_options(config: dict[str, Any], path: str) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"adapter {path!r} has peft_type={peft_type!r}; only 'LORA' adapters are supported")
    bias = config.get("bias", "none")
    if bias != "none":
        raise LoRAError(f"LoRA adapter {path!r} has bias={bias!r}; only bias='none' is supported")
    for option, (meaning, accepted) in _UNSUPPORTED_OPTIONS.items():
        value = config.get(option)
        if value and value != accepted:
            raise LoRAError(f"LoRA adapter {path!r} uses {meaning}: {option}={value!r} is not supported")


def _check_targets(target_modules: Any, layer_shapes: Mapping[str, tuple[int, int]], path: str) -> None:
    """Every name in target_modules must match some adaptable layer: an adapter
    whose targets this model lacks was trained for another architecture."""
    if target_modules is None or target_modules == "all-linear":
        return
    if isinstance(target_modules, str):
        if not any(re.fullmatch(target_modules, name) for name in layer_shapes):
            raise LoRAError(f"LoRA adapter {path!r}: target_modules pattern {target_modules!r} matches "
                            "no adaptable linear layer of this model")
        return
    unmatched = [target for target in target_modules
                 if not any(name == target or name.endswith("." + target) for name in layer_shapes)]
    if unmatched:
        leaf_names = sorted({name.rsplit(".", 1)[-1] for name in layer_shapes})
        raise LoRAError(f"LoRA adapter {path!r} targets modules not found among the model's adaptable linear "
                        f"layers: {', '.join(map(repr, unmatched))}; adaptable layers: {', '.join(leaf_names)}")


def _tensor_shapes(weights_path: str) -> dict[str, tuple[int, ...]]:
    try:
        with safe_open(weights_path, framework="pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except Exception as exc:  # safetensors raises its own error types for bad files
        raise LoRAError(f"cannot read LoRA weights {weights_path!r}: {exc}") from exc


def _pair_keys(shapes: Mapping[str, tuple[int, ...]], path: str) -> dict[str, tuple[str, str]]:
    """module name -> (lora_A key, lora_B key); any other tensor is an error."""
    halves: dict[str, dict[str, str]] = {}
    for key in shapes:
        match = _WEIGHT_KEY.match(key)
        if match is None:
            what = "LoRA on embeddings" if "lora_embedding" in key else "a tensor that is not lora_A/lora_B"
            raise LoRAError(f"LoRA adapter {path!r} holds {what} ({key!r}), which is not supported")
        halves.setdefault(match["module"], {})[match["kind"]] = key
    pairs = {}
    for module, keys in halves.items():
        if set(keys) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {path!r} has lora_{''.join(keys)} but not both halves for {module!r}")
        pairs[module] = (keys["A"], keys["B"])
    return pairs


def _rank_and_alpha(config: dict[str, Any], module: str, path: str) -> tuple[int, float]:
    """r and lora_alpha for one module; rank_pattern/alpha_pattern keys match a
    module when they match the whole name or its last dotted components."""
    rank = config.get("r", 8)
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("rank_pattern") or {}).items():
        if re.fullmatch(rf"(?:.*\.)?(?:{pattern})", module):
            rank = value
            break
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(?:.*\.)?(?:{pattern})", module):
            alpha = value
            break
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAError(f"LoRA adapter {path!r}: lora_alpha must be a number, got {alpha!r}")
    return _positive_int(rank, "r", path), float(alpha)


def _check_shapes(path: str, module: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...], rank: int,
                  layer_shape: tuple[int, int], max_lora_rank: int) -> None:
    in_features, out_features = layer_shape
    if len(a_shape) == 2 and a_shape[0] > max_lora_rank:
        raise LoRAError(f"LoRA adapter {path!r} has rank {a_shape[0]} at {module!r}, "
                        f"above max_lora_rank={max_lora_rank}")
    if a_shape != (rank, in_features) or b_shape != (out_features, rank):
        raise LoRAError(
            f"LoRA adapter {path!r} at {module!r}: lora_A {list(a_shape)} and lora_B {list(b_shape)} do not fit "
            f"rank {rank} and the layer's [in={in_features}, out={out_features}]"
        )


def _positive_int(value: Any, name: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoRAError(f"LoRA adapter {path!r}: {name} must be a positive integer, got {value!r}")
    return value
