"""Each decoder layer's kind in the engine's caches, read from the model's config.

transformers' ``config.layer_types`` names each layer's type; the engine holds a
layer as one of: "full", "sliding_window" or "chunked" attention (keys and values in
the paged KV cache), "recurrent" (per-request state slots, engine/recurrent/), a
"hybrid" type's attention kind (a layer that keeps both: zamba, falcon_h1, zaya), or
"none" (a layer without token mixing). A type none of these covers has no kind: the
model is refused (engine/model/support.py) rather than run without that state.
"""

from __future__ import annotations

import transformers

from ..errors import UnsupportedLayerError
from ..recurrent import kinds as _recurrent_kinds  # noqa: F401  (registers the kinds)
from ..recurrent.base import kind_for_layer_type, recurrent_model_types

# transformers' config.layer_types values the engine's paged KV cache holds, and their
# kind there (engine/model/kv_cache_spec.py).
# A sparse attention's "indexed_attention" layer keeps full context (its index keys beside
# its latents) and selects among it when attending (engine/model/adapters/indexer.py);
# DeepSeek-V4's compressed layers keep full context too (raw keys, and per token the
# compressors' rows: engine/model/adapters/deepseek_v4.py).
LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding_window", "chunked_attention": "chunked",
               "indexed_attention": "full", "compressed_sparse_attention": "full",
               "heavily_compressed_attention": "full"}
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
# Types whose "hybrid" layers are attention layers that also convolve short spans of
# their streams, the convolutions' inputs cached per token beside the values
# (engine/model/adapters/inkling.py): no recurrent state.
_CONVOLVING_ATTENTION = {name: {"hybrid": "full", "hybrid_sliding": "sliding_window"}
                         for name in ("inkling_text", "inkling2_text", "inkling2_loop_text")}
# Types whose config names no layer types but whose every attention layer takes the
# config's sliding_window when it is set: those layers are sliding-window layers.
_WINDOWED_WITHOUT_LAYER_TYPES = ("mistral", "mixtral", "phi3", "starcoder2", "ministral3")


def _registered_recurrent(hf_config: transformers.PretrainedConfig, layer_type: str) -> bool:
    model_types = {hf_config.model_type, hf_config.get_text_config().model_type}
    return any(kind_for_layer_type(model_type, layer_type) for model_type in model_types)


def layer_kind(hf_config: transformers.PretrainedConfig, layer_type: str) -> str | None:
    """The cache kind of a layer_types entry of this config's model, None if unsupported."""
    if layer_type in LAYER_KINDS:
        return LAYER_KINDS[layer_type]
    if layer_type in _NO_STATE_TYPES:
        return NO_STATE
    convolving = _CONVOLVING_ATTENTION.get(hf_config.get_text_config().model_type, {})
    if layer_type in convolving:
        return convolving[layer_type]
    if _registered_recurrent(hf_config, layer_type):
        return _HYBRID.get(layer_type, RECURRENT)
    return None


def keeps_state(hf_config: transformers.PretrainedConfig, layer_type: str) -> bool:
    """Whether a layer of this type keeps recurrent state (a recurrent or hybrid layer)."""
    return layer_type not in LAYER_KINDS and _registered_recurrent(hf_config, layer_type)


def declared_layer_types(hf_config: transformers.PretrainedConfig) -> list[str]:
    """Each decoder layer's type as the config declares it (transformers'
    ``layer_types``; full attention where the config names none, unless its type's
    layers are all one recurrent kind), kind or not."""
    text_config = hf_config.get_text_config()
    num_layers = text_config.num_hidden_layers
    # A type whose every layer is one recurrent kind may name no layer types (RWKV):
    # its kind is registered under the layer type "recurrent".
    default = RECURRENT if kind_for_layer_type(text_config.model_type, RECURRENT) else "full_attention"
    if text_config.model_type in _WINDOWED_WITHOUT_LAYER_TYPES and getattr(text_config, "sliding_window", None):
        default = "sliding_attention"
    return list(getattr(text_config, "layer_types", None) or [default] * num_layers)[:num_layers]


def unknown_layer_reason(hf_config: transformers.PretrainedConfig) -> tuple[int, str] | None:
    """(index, why) of the first layer no kind holds, or None when every layer has one."""
    for index, layer_type in enumerate(declared_layer_types(hf_config)):
        if layer_kind(hf_config, layer_type) is None:
            return index, (
                f"layer {index} is a {layer_type!r} layer, which keeps state that is not keys and values or "
                f"attends differently; shardline runs layers of types {', '.join(LAYER_KINDS)}, and the "
                f"recurrent layers of {', '.join(recurrent_model_types())}")
    return None


def layer_types(hf_config: transformers.PretrainedConfig) -> list[str]:
    """Each decoder layer's type (``declared_layer_types``). Raises UnsupportedLayerError,
    naming the first layer no kind holds."""
    unknown = unknown_layer_reason(hf_config)
    if unknown is not None:
        architecture = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
        raise UnsupportedLayerError(f"{architecture} ({hf_config.model_type}) {unknown[1]}")
    return declared_layer_types(hf_config)


def recurrent_layer_indices(hf_config: transformers.PretrainedConfig) -> list[int]:
    """The layers that keep recurrent state (recurrent and hybrid ones)."""
    return [index for index, layer_type in enumerate(layer_types(hf_config)) if keeps_state(hf_config, layer_type)]
