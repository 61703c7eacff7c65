"""Loading a Hugging Face model, tokenizer and generation config from a hub id or a
local directory, with the engine's attention plugged in."""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from ..attention.context import register as register_attention
from .adapters import UnsupportedAttentionError, adapt_attention, has_adapter
from ..config import EngineConfig
from ..errors import ModelLoadError, UnsupportedLayerError, UnsupportedModelError
from ..recurrent.base import kind_for_layer_type, recurrent_model_types
from ..recurrent.unsupported import unsupported_reason
from ..recurrent import kinds as _recurrent_kinds  # noqa: F401  (registers the kinds)

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: transformers.PreTrainedTokenizerBase
    hf_config: transformers.PretrainedConfig
    generation_config: transformers.GenerationConfig | None
    device: torch.device
    dtype: torch.dtype


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


# transformers' config.layer_types values the engine's paged KV cache holds, and their
# kind there (engine/model/kv_cache_spec.py).
LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding_window", "chunked_attention": "chunked"}
# A layer registered as a recurrent kind for its model type (engine/recurrent/) keeps
# per-request state slots instead of KV blocks; a "hybrid" one (an attention block and a
# recurrent mixer side by side: zamba, falcon_h1) keeps both. Layers without token
# mixing (nemotron_h's "mlp" and "moe" layers) keep neither.
RECURRENT = "recurrent"
NO_STATE = "none"
# Hybrid layer types and the attention their layers keep KV blocks for (zaya's
# "hybrid_sliding": its CCA projection's state beside a sliding-window attention).
_HYBRID = {"hybrid": "full", "hybrid_sliding": "sliding_window"}
_NO_STATE_TYPES = ("mlp", "moe")


def _registered_recurrent(hf_config: transformers.PretrainedConfig, layer_type: str) -> bool:
    model_types = {hf_config.model_type, hf_config.get_text_config().model_type}
    return any(kind_for_layer_type(model_type, layer_type) for model_type in model_types)


def layer_kind(hf_config: transformers.PretrainedConfig, layer_type: str) -> str | None:
    """The cache kind of a layer_types entry of this config's model, None if unsupported."""
    if layer_type in LAYER_KINDS:
        return LAYER_KINDS[layer_type]
    if layer_type in _NO_STATE_TYPES:
        return NO_STATE
    if _registered_recurrent(hf_config, layer_type):
        return _HYBRID.get(layer_type, RECURRENT)
    return None


def recurrent_layer_indices(hf_config: transformers.PretrainedConfig) -> list[int]:
    """The layers that keep recurrent state (recurrent and hybrid ones)."""
    return [index for index, layer_type in enumerate(layer_types(hf_config))
            if layer_type not in LAYER_KINDS and _registered_recurrent(hf_config, layer_type)]


def key_value_heads(layer_config: transformers.PretrainedConfig, num_heads: int) -> int:
    """How many key-value heads a layer's attention caches: the config's
    num_key_value_heads, else what older configs say in their own words (falcon's
    num_kv_heads with its new decoder architecture, one head for multi-query
    attention: falcon, gpt_bigcode), else one per query head."""
    heads = getattr(layer_config, "num_key_value_heads", None)
    if heads and getattr(layer_config, "model_type", None) == "jetmoe":
        # Each of its top-k attention experts attends the same keys: it passes them repeated.
        return heads * layer_config.num_experts_per_tok
    if heads:
        return heads
    if getattr(layer_config, "new_decoder_architecture", False):
        return layer_config.num_kv_heads
    return 1 if getattr(layer_config, "multi_query", False) else num_heads


def value_cache_head_size(layer_config: transformers.PretrainedConfig, value_head_dim: int) -> int:
    """The head size a layer's value cache holds: its values', except diffllama's, whose
    adapter attends its two value sets side by side (engine/model/adapters/shapes.py)."""
    return 2 * value_head_dim if getattr(layer_config, "model_type", None) == "diffllama" else value_head_dim


def layer_types(hf_config: transformers.PretrainedConfig) -> list[str]:
    """Each decoder layer's type (transformers' ``layer_types``; full attention where
    the config names none). Raises UnsupportedLayerError, naming the first layer this
    cache cannot hold."""
    text_config = hf_config.get_text_config()
    refused = unsupported_reason(hf_config.model_type)
    if refused is not None:
        architecture = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
        raise UnsupportedLayerError(f"{architecture} ({hf_config.model_type}) is refused: {refused}")
    num_layers = text_config.num_hidden_layers
    types = list(getattr(text_config, "layer_types", None) or ["full_attention"] * num_layers)[:num_layers]
    for index, layer_type in enumerate(types):
        if layer_kind(hf_config, layer_type) is None:
            architecture = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
            raise UnsupportedLayerError(
                f"{architecture} ({hf_config.model_type}) layer {index} is a {layer_type!r} layer, which keeps "
                f"state that is not keys and values or attends differently; shardline runs layers of types "
                f"{', '.join(LAYER_KINDS)}, and the recurrent layers of {', '.join(recurrent_model_types())}")
    return types


# Model types whose attention layers call transformers' AttentionInterface although
# their classes do not declare _supports_attention_backend (read in their modeling code;
# the load check compares their outputs with their own forward all the same).
UNDECLARED_ATTENTION_INTERFACE = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}


def routes_attention_interface(model_class: type, hf_config: transformers.PretrainedConfig) -> bool:
    """Whether the model's attention layers call transformers' AttentionInterface, or
    are replaced by adapters that call the engine's paged attention (engine/model/adapters/)
    (true of a model without attention layers, such as a pure state-space model)."""
    if getattr(model_class, "_supports_attention_backend", False) or hf_config.model_type in UNDECLARED_ATTENTION_INTERFACE:
        return True
    if _modeling_file_calls_attention_interface(model_class) or has_adapter(model_class):
        return True
    try:
        kinds = {layer_kind(hf_config, layer_type) for layer_type in layer_types(hf_config)}
    except UnsupportedLayerError:
        return False
    return kinds <= {RECURRENT, NO_STATE}


def _modeling_file_calls_attention_interface(model_class: type) -> bool:
    """Whether the class's modeling file dispatches attention through transformers'
    AttentionInterface (some classes do without declaring _supports_attention_backend;
    the load check compares their outputs with their own forward all the same)."""
    module = sys.modules.get(model_class.__module__)
    try:
        return module is not None and "ALL_ATTENTION_FUNCTIONS.get_interface" in inspect.getsource(module)
    except (OSError, TypeError):
        return False


def check_attention_interface(model_class: type, hf_config: transformers.PretrainedConfig) -> None:
    if not routes_attention_interface(model_class, hf_config):
        architecture = (getattr(hf_config, "architectures", None) or [model_class.__name__])[0]
        raise UnsupportedModelError(
            f"architecture {architecture} ({hf_config.model_type}) does not route its attention "
            "through transformers' AttentionInterface, so shardline's paged attention cannot run it"
        )


def load_model(config: EngineConfig, auto_class: type, attn_implementation: str,
               check_config: Callable[[transformers.PretrainedConfig], object] | None = None) -> LoadedModel:
    """Load ``config.model`` through ``auto_class`` (AutoModelForCausalLM, AutoModel)
    with its attention layers calling ``attn_implementation``; ``check_config`` may
    refuse the model from its config before any weight is read."""
    hf_config = load_hf_config(config)
    if check_config is not None:
        check_config(hf_config)
    tokenizer = load_tokenizer(config)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, hf_config, device)
    model_class = auto_class._model_mapping.get(type(hf_config), None)
    if model_class is not None:
        check_attention_interface(model_class, hf_config)
    if model_class is not None and has_adapter(model_class):
        attn_implementation = "eager"  # its adapters call the paged attention; its own code wants eager
    try:
        model = auto_class.from_pretrained(
            config.model,
            dtype=dtype,
            attn_implementation=attn_implementation,
            use_safetensors=config.use_safetensors,
            **_hub_kwargs(config),
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model weights of {config.model!r}: {exc}") from exc
    check_attention_interface(type(model), hf_config)
    model.to(device).eval()
    try:
        adapt_attention(model)
    except UnsupportedAttentionError as exc:
        raise UnsupportedModelError(f"{type(model).__name__} ({hf_config.model_type}): {exc}") from None
    logger.info("loaded %s (%s) on %s in %s", config.model, type(model).__name__, device, dtype)
    return LoadedModel(model, tokenizer, hf_config, load_generation_config(config), device, dtype)


# Model types whose attention the paged KV cache cannot hold as they run it, and why.
UNSUPPORTED_MODEL_TYPES = {
    "blt": "a byte-level patch model: an entropy model cuts the bytes into patches of varying length as it "
           "reads them, a global transformer runs over the patches and local byte models cross-attend them, "
           "while the paged cache holds one token-level sequence per layer",
    "cpmant": "its prompt attends bidirectionally (each prompt token sees the whole prompt, after a learned "
              "prefix of prompt_length tokens it prepends to every sequence), with a bucketed relative "
              "position bias between segments; the paged attention is causal and prefills a prompt in "
              "chunks, so the prompt's keys and values would differ from the model's",
}


def _unsupported_reason(hf_config: transformers.PretrainedConfig) -> str | None:
    """Why the engine cannot run this model, from its config: its type, a sparse
    attention indexer, or a pass layout the paged cache cannot hold; None if it can."""
    text_config = hf_config.get_text_config()
    index_topk = getattr(text_config, "index_topk", None)
    indexer_budget = getattr(text_config, "indexer_budget", None)
    if index_topk:
        return (f"its sparse attention has an indexer pick the top {index_topk} keys of each query from an "
                "index-key cache of its own, while the paged attention attends every key and keeps no index "
                f"keys, so past {index_topk} tokens the two differ")
    if indexer_budget:
        return (f"its sparse attention has an indexer pick up to {indexer_budget} tokens of each query from "
                "blocks of averaged keys it keeps of its own, while the paged attention attends every key, so "
                f"past {indexer_budget} tokens the two differ")
    if getattr(text_config, "recurrent_kv_cache_mode", None) == "last_loop":
        return ("recurrent_kv_cache_mode 'last_loop': earlier loops of its recurrent section attend the last "
                "loop's cache without writing their own keys, which the paged attention (it writes every call's "
                "keys) cannot do; its 'per_loop' mode runs")
    return UNSUPPORTED_MODEL_TYPES.get(hf_config.model_type)


def check_causal_lm(hf_config: transformers.PretrainedConfig) -> list[str]:
    """Refuse a model the engine cannot run (``_unsupported_reason``) or a layer it
    cannot hold (``layer_types``), from the config alone; the layer types."""
    reason = _unsupported_reason(hf_config)
    if reason is not None:
        architecture = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
        raise UnsupportedModelError(f"{architecture} ({hf_config.model_type}) cannot run on shardline: {reason}")
    return layer_types(hf_config)


def load_causal_lm(config: EngineConfig) -> LoadedModel:
    """A decoder-only causal LM whose attention layers use the engine's paged attention."""
    return load_model(config, transformers.AutoModelForCausalLM, register_attention(), check_config=check_causal_lm)
