"""Loading a Hugging Face model, tokenizer and generation config from a hub id or a
local directory, with the engine's attention plugged in."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import transformers

from ..attention.context import register as register_attention
from ..config import EngineConfig
from ..errors import ModelLoadError, UnsupportedModelError
from ..quantization.checkpoint import CheckpointTensors
from ..quantization.load import QuantizedWeights, checkpoint_directory, load_quantized_model
from ..quantization.methods import gguf_refusal, resolve_scheme
from .adapters import has_adapter

# recurrent_layer_indices: the engine reads it here beside load_causal_lm (llm_engine.py).
from .layer_kinds import recurrent_layer_indices  # noqa: F401
from .support import AUTO_CLASSES, Task, auto_class_for, require_supported

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass
class LoadedModel:
    """A loaded model and what came with it; ``quantized``: the linears a quantized
    checkpoint (or online quantization) leaves for the ``quantized_linears``
    preparation step (engine/quantization/load.py), None for a float model.
    ``device``: where the engine runs the model; a tensor-parallel rank's model is on
    the CPU until its sharding step (engine/parallel/placement.py) moves its share there."""

    model: torch.nn.Module
    tokenizer: transformers.PreTrainedTokenizerBase
    hf_config: transformers.PretrainedConfig
    generation_config: transformers.GenerationConfig | None
    device: torch.device
    dtype: torch.dtype
    quantized: QuantizedWeights | None = None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device='cuda' was asked for but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, hf_config: transformers.PretrainedConfig, device: torch.device) -> torch.dtype:
    """'auto' keeps the checkpoint's dtype on CUDA; on CPU it is float32, since
    half-precision matmuls are slow on most CPUs."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32


def _hub_kwargs(config: EngineConfig) -> dict:
    return {"revision": config.revision, "trust_remote_code": config.trust_remote_code}


def load_hf_config(config: EngineConfig) -> transformers.PretrainedConfig:
    refused = gguf_refusal(config.model)
    if refused is not None:
        raise UnsupportedModelError(refused)
    try:
        return transformers.AutoConfig.from_pretrained(config.model, **_hub_kwargs(config))
    except (OSError, ValueError) as exc:
        hint = "no such local directory" if not os.path.isdir(config.model) else "not a model directory"
        raise ModelLoadError(
            f"cannot load model {config.model!r} ({hint}, and not a reachable hub id): {exc}"
        ) from exc


def load_tokenizer(config: EngineConfig) -> transformers.PreTrainedTokenizerBase:
    name = config.tokenizer or config.model
    try:
        return transformers.AutoTokenizer.from_pretrained(
            name,
            revision=config.tokenizer_revision or config.revision,
            trust_remote_code=config.trust_remote_code,
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load tokenizer {name!r}: {exc}") from exc


def load_generation_config(config: EngineConfig) -> transformers.GenerationConfig | None:
    try:
        return transformers.GenerationConfig.from_pretrained(config.model, **_hub_kwargs(config))
    except (OSError, ValueError):
        return None


def key_value_heads(layer_config: transformers.PretrainedConfig, num_heads: int) -> int:
    """How many key-value heads a layer's attention caches: the count its attention
    reads, where a config also keeps a top-level num_key_value_heads mirror that may
    disagree with it: a nested attention config's (dbrx's ``attn_config.kv_n_heads``),
    then older configs' own words (falcon's num_kv_heads with its new decoder
    architecture; ``multi_query``: one head, else one per query head: falcon,
    gpt_bigcode); else the config's num_key_value_heads, else one per query head."""
    nested = _nested_kv_heads(layer_config)
    if nested is not None:
        return nested
    if getattr(layer_config, "new_decoder_architecture", False):
        return layer_config.num_kv_heads
    if getattr(layer_config, "multi_query", None) is not None:
        # Its attention reads multi_query; a num_key_value_heads beside it is a derived mirror.
        return 1 if layer_config.multi_query else num_heads
    heads = getattr(layer_config, "num_key_value_heads", None)
    if heads and getattr(layer_config, "model_type", None) == "jetmoe":
        # Each of its top-k attention experts attends the same keys: it passes them repeated.
        return heads * layer_config.num_experts_per_tok
    return heads or num_heads


def _nested_kv_heads(layer_config: transformers.PretrainedConfig) -> int | None:
    """The key-value head count a nested ``attn_config`` (a sub-config or a dict) names, if any."""
    attn_config = getattr(layer_config, "attn_config", None)
    heads = attn_config.get("kv_n_heads") if isinstance(attn_config, dict) else getattr(attn_config, "kv_n_heads", None)
    return int(heads) if heads else None


def value_cache_head_size(layer_config: transformers.PretrainedConfig, value_head_dim: int) -> int:
    """The head size a layer's value cache holds: its values', except diffllama's, whose
    adapter attends its two value sets side by side (engine/model/adapters/shapes.py)."""
    return 2 * value_head_dim if getattr(layer_config, "model_type", None) == "diffllama" else value_head_dim


class ModelReader(Protocol):
    """Reads a float checkpoint's model in place of transformers' ``from_pretrained``
    (a tensor-parallel rank's, engine/parallel/loading.py); None where it does not
    apply, and the loader reads the checkpoint whole."""

    def __call__(self, config: EngineConfig, auto_class: type, hf_config: transformers.PretrainedConfig,
                 dtype: torch.dtype, attn_implementation: str | dict[str, str]) -> torch.nn.Module | None: ...

    def quantized_splits(self, config: EngineConfig, model: torch.nn.Module, tensors: CheckpointTensors,
                         read_elsewhere: set[str]) -> set[str]:
        """For a quantized checkpoint: the float parameters of ``model`` (a skeleton) left
        on the meta device, read after the split (never one of ``read_elsewhere``)."""
        ...


def load_model(config: EngineConfig, task: Task, attn_implementation: str,
               reader: ModelReader | None = None) -> LoadedModel:
    """Load ``config.model`` for ``task`` ("generate": AutoModelForCausalLM, "embed":
    AutoModel) with its attention layers calling ``attn_implementation``. The model is
    refused (``require_supported``, engine/model/support.py) before any weight is read.
    ``reader``: reads a float checkpoint's model instead of ``from_pretrained``."""
    hf_config = load_hf_config(config)
    require_supported(hf_config, task, trust_remote_code=config.trust_remote_code, quantization=config.quantization)
    tokenizer = load_tokenizer(config)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, hf_config, device)
    auto_class = auto_class_for(hf_config, task)
    model_class = auto_class._model_mapping.get(type(hf_config), None)
    if model_class is not None and has_adapter(model_class):
        attn_implementation = "eager"  # its adapters call the paged attention; its own code wants eager
    implementation: str | dict[str, str] = attn_implementation
    if auto_class is not AUTO_CLASSES[task]:
        implementation = text_attention_only(hf_config, attn_implementation)
    scheme = resolve_scheme(hf_config, config.quantization)
    if scheme is not None:
        if task != "generate":
            raise UnsupportedModelError(f"{config.model} is quantized as {scheme.description}, which only the "
                                        "generation engine runs (task 'generate')")
        # A tensor-parallel rank (``reader`` given) reads its shares of quantized experts as slices.
        model, quantized = load_quantized_model(
            auto_class, hf_config, checkpoint_directory(config.model, config.revision), scheme, dtype, device,
            attn_implementation, read_experts=reader is None,
            defer=functools.partial(reader.quantized_splits, config) if reader is not None else None)
        logger.info("loaded %s (%s) on %s in %s, %s", config.model, type(model).__name__, device, dtype,
                    scheme.description)
        return LoadedModel(model, tokenizer, hf_config, load_generation_config(config), device, dtype, quantized)
    model = reader(config, auto_class, hf_config, dtype, implementation) if reader is not None else None
    if model is None:
        model = _from_pretrained(config, auto_class, dtype, implementation)
    logger.info("loaded %s (%s) on %s in %s", config.model, type(model).__name__, device, dtype)
    return LoadedModel(model, tokenizer, hf_config, load_generation_config(config), device, dtype)


def _from_pretrained(config: EngineConfig, auto_class: type, dtype: torch.dtype,
                     implementation: str | dict[str, str]) -> torch.nn.Module:
    """The whole model read by transformers, refusing weights it lacks."""
    try:
        model = auto_class.from_pretrained(
            config.model,
            dtype=dtype,
            attn_implementation=implementation,
            **experts_implementation(dtype),
            use_safetensors=config.use_safetensors,
            output_loading_info=True,
            **_hub_kwargs(config),
        )
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: weights of another shape
        raise ModelLoadError(f"cannot load model weights of {config.model!r}: {exc}") from exc
    model, loading_info = model
    _refuse_missing_weights(config.model, type(model).__name__, loading_info)
    # On its device before the engine's surgery (engine/parts/build.py); a tensor-parallel rank's stays
    # on the CPU, where the surgery's sharding step splits it and moves only its share to ``device``.
    return model.to(resolve_device(config.device) if config.tensor_parallel_size == 1
                    else torch.device("cpu")).eval()


def experts_implementation(dtype: torch.dtype) -> dict[str, str]:
    """The keyword that runs a float64 model's experts eagerly: transformers' default
    grouped experts call torch's grouped_mm, which takes no float64 (a float64 MoE
    model would fail at its first forward). Eager experts are what its float64
    reference runs too."""
    return {"experts_implementation": "eager"} if dtype == torch.float64 else {}


def _refuse_missing_weights(model_name: str, class_name: str, loading_info: dict[str, Any]) -> None:
    """transformers initialises weights the checkpoint lacks (or holds in another
    shape) at random with only a warning; a model run that way is silently wrong, so
    the engine refuses it, naming the first few tensors."""
    for kind in ("missing_keys", "mismatched_keys"):
        names = sorted(str(key[0] if isinstance(key, tuple) else key) for key in loading_info.get(kind) or ())
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            what = "lacks" if kind == "missing_keys" else "holds in another shape"
            raise ModelLoadError(f"the checkpoint of {model_name!r} {what} weights {class_name} needs ({shown}); "
                                 "transformers would initialise them at random, so shardline does not load it")


def text_attention_only(hf_config: transformers.PretrainedConfig, attn_implementation: str) -> dict[str, str]:
    """Per sub-config attention implementations of a vision-language model: the text
    model's is ``attn_implementation`` (the paged attention), the encoders' sdpa (they
    run on whole images, outside the paged cache)."""
    text_key = next((name for name in getattr(hf_config, "sub_configs", {})
                     if getattr(hf_config, name, None) is hf_config.get_text_config()), "text_config")
    implementations = {name: "sdpa" for name in getattr(hf_config, "sub_configs", {})}
    return {"": "sdpa", **implementations, text_key: attn_implementation}


def load_causal_lm(config: EngineConfig, reader: ModelReader | None = None) -> LoadedModel:
    """A decoder-only causal LM whose attention layers use the engine's paged attention
    (``reader``: as ``load_model``'s)."""
    return load_model(config, "generate", register_attention(), reader)
