"""compressed-tensors checkpoints (Red Hat / Neural Magic's llm-compressor output):
their config read by the compressed-tensors package, mapped to a QuantScheme.

Read: FP8 W8A8 ("float-quantized": fp8 weight, per-tensor, per-channel or block
``weight_scale``), INT8 ("int-quantized": int8 weight, per-tensor, per-channel or group
scale [N, K / g], and ``weight_zero_point`` of the scale's shape when asymmetric; W8A8
or weight-only) and W4A16 / W8A16 ("pack-quantized": 4-bit ints eight, or 8-bit ints
four, to an int32 in ``weight_packed``, group or channel ``weight_scale``,
``weight_zero_point`` packed the same way along the output channels when asymmetric,
``weight_g_idx`` with group act-order). Refused with one line: NVFP4 and the MX
formats, 2:4 sparsity, several schemes in one checkpoint, other bit widths.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from ..errors import UnsupportedModelError
from .activations import InputQuantization
from .scheme import QuantScheme

logger = logging.getLogger(__name__)

_NVFP4_FORMATS = {"nvfp4-pack-quantized"}
_READ_FORMATS = {"float-quantized", "int-quantized", "pack-quantized", "naive-quantized"}


def parse_compressed_tensors(config: Mapping[str, Any]) -> QuantScheme:
    """The QuantScheme of a compressed-tensors ``quantization_config``."""
    from compressed_tensors.quantization import QuantizationConfig

    config, group_act_order = _without_group_act_order(config)
    try:
        parsed = QuantizationConfig.model_validate(config)
    except ValueError as exc:
        message = " ".join(str(exc).split())[:300]
        raise UnsupportedModelError(f"compressed-tensors quantization_config cannot be read: {message}") from exc
    schemes = [group for group in parsed.config_groups.values() if not isinstance(group, list)]
    weights = {group.weights.model_dump_json() if group.weights is not None else "" for group in schemes}
    formats = {group.format or parsed.format for group in schemes}
    if len(weights) != 1 or len(formats) != 1:
        raise UnsupportedModelError(
            f"compressed-tensors checkpoint with {len(schemes)} config_groups of different schemes "
            f"(formats {sorted(map(str, formats))}) is not run by shardline (it runs one scheme per checkpoint); "
            "vLLM runs mixed schemes")
    scheme = schemes[0]
    fmt = str(formats.pop())
    if scheme.weights is None:
        raise UnsupportedModelError("compressed-tensors checkpoint quantizes no weights (activations or the KV "
                                    "cache only), which shardline does not run; vLLM does")
    if fmt in _NVFP4_FORMATS:
        raise UnsupportedModelError(f"NVFP4 weights (compressed-tensors format {fmt!r}) are not run by shardline "
                                    "(no FP4 kernel); vLLM runs them on GPUs with FP4 tensor cores (NVIDIA Blackwell)")
    if fmt not in _READ_FORMATS:
        raise UnsupportedModelError(f"compressed-tensors format {fmt!r} is not read by shardline (it reads "
                                    f"{', '.join(sorted(_READ_FORMATS))}); vLLM runs it")
    if parsed.kv_cache_scheme is not None:
        logger.warning("compressed-tensors kv_cache_scheme is not applied: the engine's KV cache keeps the model's "
                       "dtype (its k_scale/v_scale tensors are not read)")
    found = _weight_scheme(scheme.weights, scheme.input_activations, fmt, tuple(parsed.ignore or ()))
    return dataclasses.replace(found, act_order=True) if group_act_order else found


def _without_group_act_order(config: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The config with actorder "group" read as "weight", and whether any group said
    "group". Checkpoints made with it store ``weight_g_idx`` (read by formats.py),
    while current compressed-tensors releases no longer validate the value."""
    config = copy.deepcopy(dict(config))
    found = False
    for group in (config.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("actorder") == "group":
            weights["actorder"] = "weight"
            found = True
    return config, found


def _weight_scheme(weights: Any, activations: Any, fmt: str, ignore: tuple[str, ...]) -> QuantScheme:
    """The QuantScheme of one config group's weight (and input activation) arguments."""
    kind, bits, strategy = str(weights.type), int(weights.num_bits), str(weights.strategy)
    described = f"compressed-tensors {kind}{bits} weights ({fmt}, strategy {strategy!r})"
    act = "none" if activations is None else ("dynamic" if activations.dynamic else "static")
    inputs = _input_quantization(activations, described)
    if kind == "int" and fmt == "pack-quantized":
        scheme = _packed_scheme(weights, bits, strategy, described)
        return dataclasses.replace(scheme, activations=act if bits == 8 else "none", input_quantization=inputs,
                                   ignore=ignore)
    if kind == "float" and bits == 8 and strategy in ("tensor", "channel", "block"):
        block = tuple(weights.block_structure) if strategy == "block" else None
        if strategy == "block" and (block is None or len(block) != 2):
            raise UnsupportedModelError(f"{described}: block_structure {weights.block_structure!r} is not [rows, cols]")
        return QuantScheme(method="compressed-tensors", weights="fp8", layout="w8", strategy=strategy,  # type: ignore[arg-type]
                           block=(int(block[0]), int(block[1])) if block else None, activations=act,
                           input_quantization=inputs, ignore=ignore)
    if kind == "int" and bits == 8 and strategy in ("tensor", "channel"):
        return QuantScheme(method="compressed-tensors", weights="int8", layout="w8", strategy=strategy,  # type: ignore[arg-type]
                           symmetric=bool(weights.symmetric), activations=act, input_quantization=inputs,
                           ignore=ignore)
    if kind == "int" and bits == 8 and strategy == "group":
        # Group scales (and zero points) [N, K / group_size]: W8 blocks of one row by a group.
        group_size = _group_size(weights, described)
        return QuantScheme(method="compressed-tensors", weights="int8", layout="w8", strategy="group",
                           block=(1, group_size), group_size=group_size, symmetric=bool(weights.symmetric),
                           activations=act, input_quantization=inputs, ignore=ignore)
    raise UnsupportedModelError(f"{described} are not run by shardline (it runs fp8 and int8 per tensor or "
                                "channel, int8 by group, fp8 blocks, and pack-quantized int4 and int8 by group or "
                                "channel); vLLM runs others")


def _packed_scheme(weights: Any, bits: int, strategy: str, described: str) -> QuantScheme:
    """pack-quantized: 4-bit codes become the W4 layout, 8-bit ones W8 int8 (per channel,
    or blocks of one row by a group), either with its zero points when asymmetric."""
    if bits not in (4, 8):
        raise UnsupportedModelError(f"{described}: num_bits {bits} is not run by shardline (it unpacks 4- and "
                                    "8-bit pack-quantized codes); vLLM runs others")
    if strategy not in ("group", "channel"):
        raise UnsupportedModelError(f"{described} are not run by shardline (it runs pack-quantized weights by "
                                    "group or channel); vLLM runs others")
    group_size = _group_size(weights, described) if strategy == "group" else None
    symmetric, act_order = bool(weights.symmetric), weights.actorder is not None
    if bits == 4:
        if group_size is not None and group_size % 2:
            raise UnsupportedModelError(f"{described}: group_size {group_size} is not an even positive integer")
        return QuantScheme(method="compressed-tensors", weights="int4", layout="packed", strategy="group",
                           group_size=group_size, symmetric=symmetric, act_order=act_order)
    return QuantScheme(method="compressed-tensors", weights="int8", layout="packed", strategy=strategy,  # type: ignore[arg-type]
                       block=None if group_size is None else (1, group_size), group_size=group_size,
                       symmetric=symmetric, act_order=act_order)


def _group_size(weights: Any, described: str) -> int:
    group_size = int(weights.group_size or 0)
    if group_size <= 0:
        raise UnsupportedModelError(f"{described}: group_size {weights.group_size!r} is not a positive integer")
    return group_size


def _input_quantization(activations: Any, described: str) -> InputQuantization:
    """How the checkpoint's own forward quantizes each linear's input: compressed-tensors
    fake-quantizes it by ``input_activations`` before the product. Refused where
    shardline does not compute that (engine/quantization/activations.py)."""
    if activations is None:
        return "none"
    kind, bits, strategy = str(activations.type), int(activations.num_bits), str(activations.strategy)
    if (bits == 8 and kind in ("int", "float") and strategy == "token" and activations.dynamic is True
            and activations.symmetric):
        return "int8" if kind == "int" else "fp8"
    raise UnsupportedModelError(
        f"{described}: input_activations {kind}{bits} (strategy {strategy!r}, dynamic {activations.dynamic!r}, "
        f"symmetric {activations.symmetric!r}) are not quantized by shardline (it quantizes inputs as dynamic "
        "symmetric int8 or fp8 per token); vLLM runs them")
