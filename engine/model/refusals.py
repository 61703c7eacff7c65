"""The rules that refuse a model from its config alone, each with the reason a user is
told: model types the engine's caches cannot hold as they run, sparse-attention
indexers, and a loop layout the paged attention cannot follow.

engine/model/support.py reads these first; the rules that need the model's classes
(its attention, its recurrent modules) are there.
"""

from __future__ import annotations

import transformers

from .adapters.deepseek_v4 import COMPRESSED_MODEL_TYPES
from .adapters.latent import latent_cache_refusal, selects_keys
from .adapters.qwen4_exp import QSA_MODEL_TYPES, qsa_refusal

_INKLING2 = "an image-text model whose vision tower and image rows shardline does not run; its text model, {}, runs"

# Model types the engine cannot run exactly, and why (a composite type's text type too:
# a config is refused when either its type or its text part's type is listed).
REFUSED_MODEL_TYPES: dict[str, str] = {
    "blt": "a byte-level patch model: an entropy model cuts the bytes into patches of varying length as it "
           "reads them, a global transformer runs over the patches and local byte models cross-attend them, "
           "while the paged cache holds one token-level sequence per layer",
    "cpmant": "its prompt attends bidirectionally (each prompt token sees the whole prompt, after a learned "
              "prefix of prompt_length tokens it prepends to every sequence), with a bucketed relative "
              "position bias between segments; the paged attention is causal and prefills a prompt in "
              "chunks, so the prompt's keys and values would differ from the model's",
    **{name: _INKLING2.format(f"{name}_text") for name in ("inkling2", "inkling2_loop")},
}


# Sparse attentions the latent adapter does not run yet, and how each departs from the
# indexed latent attention it runs (deepseek_v32's: one index key per token, top-k over them).
_INDEXER_SHAPES: dict[str, str] = {
}


def _indexer_reason(text_config: transformers.PretrainedConfig) -> str | None:
    """Why a sparse attention's indexer cannot run on the paged attention, or None.
    The latent types with an indexer (adapters/latent.py's ``selects_keys``) run it
    over their latents; the others are refused."""
    index_topk = getattr(text_config, "index_topk", None)
    if index_topk and selects_keys(text_config):
        latent_reason = latent_cache_refusal(text_config)
        if latent_reason is not None:
            return (f"its sparse attention selects keys among cached latents, which this checkpoint cannot "
                    f"keep: {latent_reason}")
        indexer_types = getattr(text_config, "indexer_types", None)
        if indexer_types and indexer_types[0] != "full":
            return (f"indexer_types[0] is {indexer_types[0]!r}: its first layer reuses a previous layer's key "
                    "selection, and there is none")
        return None
    if index_topk and text_config.model_type in COMPRESSED_MODEL_TYPES:
        return None  # its indexer ranks compressed keys (adapters/deepseek_v4.py)
    if index_topk and text_config.model_type in _INDEXER_SHAPES:
        return _INDEXER_SHAPES[text_config.model_type]
    if index_topk:
        return (f"its sparse attention has an indexer pick the top {index_topk} keys of each query from an "
                "index-key cache of its own, while the paged attention attends every key and keeps no index "
                f"keys, so past {index_topk} tokens the two differ")
    indexer_budget = getattr(text_config, "indexer_budget", None)
    if indexer_budget and text_config.model_type in QSA_MODEL_TYPES:
        return qsa_refusal(text_config)  # its indexer picks blocks of tokens (adapters/qwen4_exp.py)
    if indexer_budget:
        return (f"its sparse attention has an indexer pick up to {indexer_budget} tokens of each query from "
                "blocks of averaged keys it keeps of its own, while the paged attention attends every key, so "
                f"past {indexer_budget} tokens the two differ")
    return None


def config_refusal(hf_config: transformers.PretrainedConfig) -> str | None:
    """Why the engine cannot run this model, from its config: its type, a sparse
    attention indexer, or a pass layout the paged cache cannot hold; None if none applies."""
    text_config = hf_config.get_text_config()
    for model_type in (hf_config.model_type, text_config.model_type):
        if model_type in REFUSED_MODEL_TYPES:
            return REFUSED_MODEL_TYPES[model_type]
    if not isinstance(getattr(text_config, "num_hidden_layers", None), int):
        return ("its config declares no stack of decoder layers (num_hidden_layers) for the paged cache to hold: "
                "it is not a decoder language model")
    indexer = _indexer_reason(text_config)
    if indexer is not None:
        return indexer
    if getattr(text_config, "recurrent_kv_cache_mode", None) == "last_loop":
        return ("recurrent_kv_cache_mode 'last_loop': earlier loops of its recurrent section attend the last "
                "loop's cache without writing their own keys, which the paged attention (it writes every call's "
                "keys) cannot do; its 'per_loop' mode runs")
    return None
