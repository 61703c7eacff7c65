"""Reading config.json's ``quantization_config`` into a QuantScheme, per quant_method.

``quant_scheme(hf_config)`` reads fp8 (per tensor or channel, or ``weight_block_size``
blocks; ``weight_scale_inv`` or ``weight_scale``), fbgemm_fp8 (per channel), compressed-tensors (FP8 and INT8
W8A8, W4A16 pack-quantized; its config read by the compressed-tensors package), gptq
(4-bit, and symmetric 8-bit; group_size, desc_act, sym, checkpoint_format), awq (gemm) and mxfp4 (gpt-oss's
experts). A format the engine does not run (NVFP4, bitsandbytes, GGUF, an unknown
method, a bit width other than 4 or 8, a layout it has no kernel for) raises
UnsupportedModelError with one line naming the format and what would run it;
``quantization_refusal`` gives that line without raising, for the engine's verdict
(engine/model/support.py), ``shardline check`` and the pipeline's pre-flight.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import UnsupportedModelError
from .scheme import QuantScheme, online_scheme

# The model types whose mxfp4 checkpoints the engine runs (their experts' module is in
# engine/quantization/experts.py's MXFP4_EXPERTS).
MXFP4_MODEL_TYPES = ("gpt_oss",)
READ_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors", "gptq", "awq", "mxfp4")


def quantization_config_of(hf_config: Any) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` as a dict (None without one); a config
    object transformers made of it is read through its ``to_dict``."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None and hasattr(hf_config, "get_text_config"):
        raw = getattr(hf_config.get_text_config(), "quantization_config", None)
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        return dict(raw)
    to_dict = getattr(raw, "to_dict", None)
    converted = to_dict() if callable(to_dict) else None
    if isinstance(converted, Mapping):
        return dict(converted)
    raise UnsupportedModelError(f"quantization_config of type {type(raw).__name__} is not a mapping")


def gguf_refusal(model: str) -> str | None:
    """The one-line refusal of a GGUF model (a .gguf file, or a directory holding GGUF
    files and no config.json), or None."""
    path = Path(os.path.expanduser(model.removeprefix("file://")))
    gguf = path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").exists()
                                      and any(path.glob("*.gguf")))
    if not gguf:
        return None
    return (f"{model} is a GGUF model, which shardline does not read (it reads safetensors checkpoints); llama.cpp "
            "runs GGUF files, or transformers converts one to safetensors (from_pretrained(..., gguf_file=...))")


def quant_scheme(hf_config: Any) -> QuantScheme | None:
    """The checkpoint's scheme from its config (None when it is not quantized);
    UnsupportedModelError for a format the engine does not run."""
    config = quantization_config_of(hf_config)
    return None if config is None else parse_quantization_config(config)


def resolve_scheme(hf_config: Any, quantization: str | None) -> QuantScheme | None:
    """The scheme the engine loads with: the checkpoint's own, which ``quantization``
    must then name (its quant_method or its weight type, "fp8" or "int8"), or the
    online scheme ``quantization`` asks for on an unquantized checkpoint; None for neither."""
    scheme = quant_scheme(hf_config)
    if scheme is None:
        return None if quantization is None else online_scheme(quantization)
    model_type = getattr(hf_config, "model_type", None)
    if scheme.weights == "mxfp4" and model_type not in MXFP4_MODEL_TYPES:
        raise UnsupportedModelError(
            f"mxfp4 weights of model type {model_type!r} are not run by shardline, which runs the mxfp4 experts "
            f"of {', '.join(MXFP4_MODEL_TYPES)} only; vLLM lists the runtimes for other mxfp4 models")
    if quantization is not None and quantization not in (scheme.method, scheme.weights):
        raise UnsupportedModelError(
            f"quantization={quantization!r} does not match the checkpoint, which is quantized as "
            f"{scheme.description}; leave quantization unset or pass {scheme.method!r}")
    return scheme


def quantization_refusal(hf_config: Any, quantization: str | None = None) -> str | None:
    """Why the engine cannot load this checkpoint's quantization (one line), or None."""
    try:
        resolve_scheme(hf_config, quantization)
    except UnsupportedModelError as exc:
        return str(exc)
    return None


def parse_quantization_config(config: Mapping[str, Any]) -> QuantScheme:
    """A QuantScheme from a ``quantization_config`` mapping (see the module docstring)."""
    method = str(config.get("quant_method", "")).lower()
    refusal = _refused_method(method, config)
    if refusal is not None:
        raise UnsupportedModelError(refusal)
    parsers = {"fp8": _parse_fp8, "fbgemm_fp8": _parse_fbgemm_fp8, "compressed-tensors": _parse_compressed_tensors,
               "gptq": _parse_gptq, "awq": _parse_awq, "mxfp4": _parse_mxfp4}
    return parsers[method](config)


def _refused_method(method: str, config: Mapping[str, Any]) -> str | None:
    """The one-line refusal for a quant_method the engine does not read, or None."""
    algorithm = str(config.get("quant_algo", "") or "").upper()
    if method == "modelopt" or "FP4" in algorithm or method in ("nvfp4", "fp4"):
        return (f"NVFP4 weights (quant_method {method!r}{f', quant_algo {algorithm!r}' if algorithm else ''}) "
                "are not run by shardline (no FP4 kernel); vLLM runs them on GPUs with FP4 tensor cores "
                "(NVIDIA Blackwell)")
    if method == "bitsandbytes" or config.get("load_in_4bit") or config.get("load_in_8bit"):
        return ("bitsandbytes weights (quant_method 'bitsandbytes') are not run by shardline; transformers with "
                "the bitsandbytes package runs them, or load the unquantized checkpoint with "
                "quantization='int8' or 'fp8'")
    if method == "gguf":
        return ("GGUF weights are not read by shardline, which reads safetensors checkpoints; llama.cpp runs GGUF "
                "files, or transformers converts one to safetensors (from_pretrained(..., gguf_file=...))")
    if method not in READ_METHODS:
        return (f"quant_method {method!r} is not a quantization shardline reads (it reads "
                f"{', '.join(READ_METHODS)}); vLLM lists the runtimes for other methods")
    return None


def _names(config: Mapping[str, Any], *keys: str) -> tuple[str, ...]:
    """The module names listed under any of ``keys`` (a missing or null list is empty)."""
    found: list[str] = []
    for key in keys:
        found.extend(str(name) for name in (config.get(key) or ()))
    return tuple(found)


def _parse_fp8(config: Mapping[str, Any]) -> QuantScheme:
    fmt = str(config.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise UnsupportedModelError(f"fp8 weights in format {fmt!r} are not run by shardline (it runs e4m3, "
                                    "torch.float8_e4m3fn); vLLM runs other FP8 formats")
    activations = str(config.get("activation_scheme", "dynamic")).lower()
    if activations not in ("dynamic", "static"):
        raise UnsupportedModelError(f"fp8 activation_scheme {activations!r} is not one shardline reads "
                                    "(dynamic or static)")
    block = config.get("weight_block_size")
    if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2
                                  and all(isinstance(size, int) and size > 0 for size in block)):
        raise UnsupportedModelError(f"fp8 weight_block_size {block!r} is not two positive integers [rows, cols]")
    return QuantScheme(
        method="fp8", weights="fp8", layout="w8", strategy="block" if block else None,
        block=(int(block[0]), int(block[1])) if block else None,
        activations="dynamic" if activations == "dynamic" else "static",
        scale_names=("weight_scale_inv", "weight_scale"),
        ignore=_names(config, "modules_to_not_convert", "ignored_layers", "ignore"))


def _parse_fbgemm_fp8(config: Mapping[str, Any]) -> QuantScheme:
    # Meta's FP8 releases: e4m3 weights with a float32 scale per output channel; its
    # kernels quantize activations per token (up to activation_scale_ub).
    return QuantScheme(method="fbgemm_fp8", weights="fp8", layout="w8", strategy="channel", activations="dynamic",
                       scale_names=("weight_scale",), ignore=_names(config, "modules_to_not_convert"))


def _parse_gptq(config: Mapping[str, Any]) -> QuantScheme:
    bits = config.get("bits")
    if bits not in (4, 8):
        raise UnsupportedModelError(f"gptq with bits={bits!r} is not run by shardline (it runs 4- and 8-bit "
                                    "GPTQ); vLLM's gptq kernels run 2 and 3 bits")
    if bits == 8 and not config.get("sym", True):
        raise UnsupportedModelError("asymmetric 8-bit gptq (sym false) is not run by shardline (its int8 layout "
                                    "has no zero point); vLLM's gptq kernels run it")
    checkpoint_format = str(config.get("checkpoint_format", "gptq") or "gptq").lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise UnsupportedModelError(f"gptq checkpoint_format {checkpoint_format!r} is not read by shardline (it "
                                    "reads 'gptq' and 'gptq_v2'); gptqmodel converts it")
    return QuantScheme(
        method="gptq", weights="int8" if bits == 8 else "int4", layout="gptq", strategy="group",
        group_size=_group_size(config, "gptq"), symmetric=bool(config.get("sym", True)),
        act_order=bool(config.get("desc_act", False)), zero_offset=1 if checkpoint_format == "gptq" else 0,
        ignore=_names(config, "modules_to_not_convert"))


def _parse_awq(config: Mapping[str, Any]) -> QuantScheme:
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise UnsupportedModelError(f"awq with bits={bits!r} is not run by shardline (it runs 4-bit AWQ)")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedModelError(f"awq version {version!r} is not read by shardline (it reads the 'gemm' "
                                    "layout); vLLM or autoawq runs it")
    if not config.get("zero_point", True):
        raise UnsupportedModelError("awq with zero_point false is not read by shardline (it reads AWQ's "
                                    "zero-point layout)")
    return QuantScheme(method="awq", weights="int4", layout="awq", strategy="group",
                       group_size=_group_size(config, "awq"), symmetric=False,
                       ignore=_names(config, "modules_to_not_convert"))


def _group_size(config: Mapping[str, Any], method: str) -> int | None:
    """Input columns per scale; None for one group over the whole row (-1)."""
    group_size = config.get("group_size", config.get("q_group_size", 128))
    if group_size == -1:
        return None
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
        raise UnsupportedModelError(f"{method} group_size {group_size!r} is not an even positive integer or -1")
    return group_size


def _parse_mxfp4(config: Mapping[str, Any]) -> QuantScheme:
    # gpt-oss quantizes its experts only; its dense linears are stored unquantized.
    return QuantScheme(method="mxfp4", weights="mxfp4", layout="float",
                       ignore=_names(config, "modules_to_not_convert"))


def _parse_compressed_tensors(config: Mapping[str, Any]) -> QuantScheme:
    from .compressed import parse_compressed_tensors

    return parse_compressed_tensors(config)


__all__ = ["READ_METHODS", "gguf_refusal", "online_scheme", "quant_scheme", "quantization_config_of",
           "quantization_refusal", "resolve_scheme"]
