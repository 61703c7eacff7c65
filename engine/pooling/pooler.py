"""How an embedding model pools its hidden states, and the pooling math.

The pooling mode comes from the model's sentence-transformers layout when it has one
(``modules.json`` naming a Pooling module, whose ``config.json`` sets
``pooling_mode_mean_tokens`` / ``pooling_mode_cls_token`` / ``pooling_mode_lasttoken``;
a Normalize module makes normalisation the default). Without that layout the
defaults are vLLM's: encoder models (BERT-like) pool the CLS token, decoder models
the last token, and embeddings are normalised.

The math works on the packed batch: hidden states [T, H] of all sequences back to
back, with ``cu_seqlens`` [B+1] marking where each starts.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers.utils.hub import cached_file

from ..params import PoolingParams


class PoolingType(str, enum.Enum):
    MEAN = "mean"
    CLS = "cls"
    LAST = "last"


class UnsupportedPoolingError(ValueError):
    """The model's sentence-transformers layout asks for something the engine cannot do."""


# sentence-transformers Pooling config flag -> our pooling type.
_ST_POOLING_FLAGS = {
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_lasttoken": PoolingType.LAST,
}
_ST_MODULE_PREFIX = "sentence_transformers.models."
_ST_SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolerConfig:
    """The model's pooling: type, default normalisation, and sentence-transformers'
    max_seq_length (None without one), with where they came from."""

    pooling_type: PoolingType
    normalize: bool
    max_seq_length: int | None = None
    source: str = "default"


def default_pooler_config(is_causal: bool) -> PoolerConfig:
    """vLLM's defaults: last token for decoders, CLS for encoders; normalised."""
    return PoolerConfig(PoolingType.LAST if is_causal else PoolingType.CLS, normalize=True)


def read_pooler_config(model: str, is_causal: bool, revision: str | None = None) -> PoolerConfig:
    """The pooling of ``model`` (local directory or hub id) from its sentence-transformers
    files, else ``default_pooler_config(is_causal)``."""
    modules = _read_json(model, "modules.json", revision)
    if modules is None:
        return default_pooler_config(is_causal)
    module_types = [str(m.get("type", "")).removeprefix(_ST_MODULE_PREFIX) for m in modules]
    unknown = [t for t in module_types if t not in _ST_SUPPORTED_MODULES]
    if unknown:
        raise UnsupportedPoolingError(
            f"{model!r} has sentence-transformers module(s) {unknown}; the engine supports only "
            f"{', '.join(_ST_SUPPORTED_MODULES)}"
        )
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    defaults = default_pooler_config(is_causal)
    pooling_type = defaults.pooling_type
    if pooling is not None:
        pooling_type = _pooling_type_from_st(model, _read_json(model, f"{pooling['path']}/config.json", revision))
    bert_config = _read_json(model, "sentence_bert_config.json", revision) or {}
    max_seq_length = bert_config.get("max_seq_length")
    return PoolerConfig(
        pooling_type,
        normalize="Normalize" in module_types,
        max_seq_length=max_seq_length if isinstance(max_seq_length, int) and max_seq_length > 0 else None,
        source="sentence-transformers",
    )


def _pooling_type_from_st(model: str, pooling_config: dict | None) -> PoolingType:
    if pooling_config is None:
        raise UnsupportedPoolingError(f"{model!r} lists a Pooling module but its config.json is missing")
    enabled = [name for name, value in pooling_config.items() if name.startswith("pooling_mode_") and value]
    if len(enabled) != 1 or enabled[0] not in _ST_POOLING_FLAGS:
        raise UnsupportedPoolingError(
            f"{model!r} pools with {enabled or 'no mode'}; the engine supports exactly one of "
            f"{', '.join(_ST_POOLING_FLAGS)}"
        )
    return _ST_POOLING_FLAGS[enabled[0]]


def _read_json(model: str, filename: str, revision: str | None) -> Any:
    """A JSON file of a local model directory or hub repo; None if it has none."""
    path = cached_file(
        model, filename, revision=revision,
        _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False,
    )
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def is_causal_config(hf_config: transformers.PretrainedConfig) -> bool:
    """Whether the model attends causally: decoder-only LMs do, BERT-like encoders do not."""
    text_config = hf_config.get_text_config()
    if getattr(text_config, "is_decoder", False):
        return True
    return type(hf_config) in transformers.AutoModelForCausalLM._model_mapping and not _is_encoder(hf_config)


def _is_encoder(hf_config: transformers.PretrainedConfig) -> bool:
    # Encoders that also have a causal-LM head class (BertLMHeadModel, ...) are
    # registered for masked LM too; decoder-only LMs are not.
    return type(hf_config) in transformers.AutoModelForMaskedLM._model_mapping


# ------------------------------------------------------------------- pooling math
def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling_type: PoolingType) -> torch.Tensor:
    """One vector per sequence. hidden: [T, H]; cu_seqlens: [B+1] int64; returns [B, H]
    in float32 (float64 for a float64 model)."""
    hidden = at_least_float32(hidden)
    if pooling_type is PoolingType.CLS:
        return hidden[cu_seqlens[:-1]]
    if pooling_type is PoolingType.LAST:
        return hidden[cu_seqlens[1:] - 1]
    seq_lens = cu_seqlens[1:] - cu_seqlens[:-1]  # [B]
    segment = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), seq_lens)  # [T]
    sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    sums.index_add_(0, segment, hidden)
    return sums / seq_lens[:, None].to(hidden.dtype)


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Half-precision states are upcast before summing or normalising."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def resolve_dimensions(params: PoolingParams, hidden_size: int, request_id: str) -> int:
    """The embedding size asked for: ``dimensions`` (at most the model's hidden size) or all."""
    if params.dimensions is None:
        return hidden_size
    if params.dimensions > hidden_size:
        raise ValueError(
            f"request {request_id!r}: dimensions={params.dimensions} exceeds the model's hidden size "
            f"{hidden_size}; use 1..{hidden_size} or None"
        )
    return params.dimensions


def finish_embedding(vectors: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """Truncate to ``dimensions`` (Matryoshka), then L2-normalise if asked.
    vectors: [..., H]; returns [..., dimensions]."""
    vectors = vectors[..., :dimensions]
    if normalize:
        vectors = torch.nn.functional.normalize(vectors, p=2, dim=-1)
    return vectors
