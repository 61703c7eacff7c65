"""The one verdict on whether a model can run on shardline, and if not, why.

``model_support(hf_config, task)`` answers for the generation engine ("generate":
transformers' AutoModelForCausalLM over the paged KV cache) and the pooling engine
("embed": AutoModel over packed attention), from the config and the model built on
the meta device: no weight is read, so the loader asks it before loading and the
pipeline's pre-flight check asks it before any shard is read. Its rules, in order:

1. the config alone (engine/model/refusals.py): refused model types, sparse-attention
   indexers, a loop layout the paged attention cannot follow; a quantization format
   (config.json's quantization_config, or the ``quantization`` option) the engine does
   not run (engine/quantization/methods.py);
2. each decoder layer's kind (engine/model/layer_kinds.py): a layer type no cache
   kind holds; for "embed", layers the packed forward cannot run (recurrent state,
   chunked attention);
3. the class the task loads: transformers has one, and it builds from the config;
4. its attention: routed through transformers' AttentionInterface, or replaced by an
   adapter (engine/model/adapters/; "generate" only); for "generate", the model builds
   with the engine's attention implementation as the loader builds it;
5. for "generate", the same module surgery the engine does at load, on the meta
   model: the attention adapters (``adapt_attention``) and the recurrent layers'
   preparation (``prepare_recurrent_layers``), whose refusals become the verdict's.

Invariant: a model this verdict accepts is not refused later by the loader or the
engine's preparation for any reason these rules cover; the loader checks nothing of
its own.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Literal

import torch
import transformers
from torch import nn

from ..attention.context import register as register_attention
from ..errors import UnsupportedLayerError, UnsupportedModelError
from ..multimodal.specs import VISION_SPECS, vision_spec
from ..quantization.methods import quantization_config_of, quantization_refusal
from ..recurrent.base import kind_for_module
from ..recurrent.state import prepare_recurrent_layers
from .adapters import adapt_attention, has_adapter
from .adapters.base import UnsupportedAttentionError
from .layer_kinds import (
    NO_STATE,
    RECURRENT,
    declared_layer_types,
    keeps_state,
    layer_kind,
    recurrent_layer_indices,
    unknown_layer_reason,
)
from .refusals import config_refusal

Task = Literal["generate", "embed"]
TASKS: tuple[Task, ...] = ("generate", "embed")
# The transformers auto class each task loads its model through.
AUTO_CLASSES: dict[Task, type] = {"generate": transformers.AutoModelForCausalLM, "embed": transformers.AutoModel}
# Model types whose attention layers call transformers' AttentionInterface although
# their classes do not declare _supports_attention_backend (read in their modeling code;
# the load check compares their outputs with their own forward all the same).
UNDECLARED_ATTENTION_INTERFACE = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
# transformers' image-text-to-text classes by model type (vision-language models).
_IMAGE_TEXT_TO_TEXT: dict[str, str] = dict(
    transformers.models.auto.modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
# Layer kinds the pooling engine's packed forward runs: it keeps no recurrent state
# (its prompts share one packed sequence) and masks no chunks.
_EMBED_KINDS = {"full", "sliding_window", NO_STATE}


@dataclass(frozen=True)
class Support:
    """The verdict on one model for one task: ``ok``, else ``reason`` says why not
    (``layer``: the decoder layer the refusal is about, where it is about one)."""

    model_type: str
    architecture: str  # the class the task loads, else the config's declared architecture
    task: Task
    reason: str | None = None
    layer: int | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def message(self) -> str:
        """One line naming the model and the reason (what a refusal's error says)."""
        if self.ok:
            return f"{self.architecture} ({self.model_type}) can run on shardline (task {self.task})"
        return f"{self.architecture} ({self.model_type}) cannot run on shardline: {self.reason}"


def auto_class_for(hf_config: transformers.PretrainedConfig, task: Task) -> type:
    """The transformers auto class ``task`` loads the config's model through: for
    "generate", AutoModelForImageTextToText for a vision-language model whose images
    the engine runs (engine/multimodal/specs.py), else AutoModelForCausalLM."""
    if task == "generate" and vision_spec(hf_config) is not None:
        return transformers.AutoModelForImageTextToText
    return AUTO_CLASSES[task]


def model_support(hf_config: transformers.PretrainedConfig, task: Task = "generate", *,
                  trust_remote_code: bool = False, quantization: str | None = None) -> Support:
    """Whether the model of ``hf_config`` can run with ``task`` ("generate" or "embed"),
    and if not, why; ``trust_remote_code`` lets a config's ``auto_map`` name its class;
    ``quantization`` is the engine's option of that name (engine/quantization/).
    Reads no weights (see the module docstring for the rules)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    auto_class = auto_class_for(hf_config, task)
    model_class = auto_class._model_mapping.get(type(hf_config), None)
    declared = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
    architecture = model_class.__name__ if model_class is not None else declared
    verdict = _config_verdict(hf_config, task)
    if verdict is not None:
        return Support(hf_config.model_type, architecture, task, *verdict)
    refused = _quantization_verdict(hf_config, task, quantization)
    if refused is not None:
        return Support(hf_config.model_type, architecture, task, refused)
    remote = trust_remote_code and auto_class.__name__ in (getattr(hf_config, "auto_map", None) or {})
    if model_class is None and not remote:
        kind = "embedding model" if task == "embed" else "causal language model"
        return Support(hf_config.model_type, architecture, task,
                       f"transformers has no {kind} class for model_type {hf_config.model_type!r} (task {task})"
                       + _vision_note(hf_config, task))
    try:
        with torch.device("meta"):
            model = auto_class.from_config(hf_config, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any failure to build is the verdict's reason
        message = " ".join(str(exc).split())[:300]
        return Support(hf_config.model_type, architecture, task,
                       f"transformers cannot build its model from the config: {type(exc).__name__}: {message}")
    reason, layer = _module_verdict(model, hf_config, task)
    if reason is None and task == "generate" and auto_class is AUTO_CLASSES[task]:
        reason = _paged_build_verdict(auto_class, hf_config, trust_remote_code)
    return Support(hf_config.model_type, type(model).__name__, task, reason, layer)


def _paged_build_verdict(auto_class: type, hf_config: transformers.PretrainedConfig,
                         trust_remote_code: bool) -> str | None:
    """Rule 4's build part: the model built on the meta device with the engine's attention
    implementation, as the loader builds it (an adapted model loads with eager and is not
    built again). A model whose code picks its attention classes from a table by
    implementation name (git's text attention) has no entry for the engine's: refused."""
    model_class = auto_class._model_mapping.get(type(hf_config), None)
    if model_class is not None and has_adapter(model_class):
        return None
    implementation = register_attention()
    try:
        with torch.device("meta"):
            auto_class.from_config(hf_config, trust_remote_code=trust_remote_code, attn_implementation=implementation)
    except KeyError as exc:
        return (f"its attention classes are chosen from a table by implementation name, with none for {exc}, "
                "instead of through transformers' AttentionInterface, so shardline's paged attention cannot run it")
    except Exception as exc:  # noqa: BLE001 - the loader would fail the same way
        message = " ".join(str(exc).split())[:300]
        return (f"transformers cannot build its model with shardline's attention implementation: "
                f"{type(exc).__name__}: {message}")
    return None


def _vision_note(hf_config: transformers.PretrainedConfig, task: Task) -> str:
    """What a refusal adds for an image-text-to-text model the engine runs no images of."""
    if task != "generate" or hf_config.model_type not in _IMAGE_TEXT_TO_TEXT:
        return ""
    return (f"; it is a vision-language model ({_IMAGE_TEXT_TO_TEXT[hf_config.model_type]}) whose image path "
            f"shardline does not run (vision-language types it runs: {', '.join(sorted(VISION_SPECS))})")


def require_supported(hf_config: transformers.PretrainedConfig, task: Task = "generate", *,
                      trust_remote_code: bool = False, quantization: str | None = None) -> Support:
    """``model_support``, raising when the model is refused: UnsupportedLayerError when
    the reason is one layer, else UnsupportedModelError; the message names the
    architecture, the model type and the reason."""
    support = model_support(hf_config, task, trust_remote_code=trust_remote_code, quantization=quantization)
    if not support.ok:
        error = UnsupportedLayerError if support.layer is not None else UnsupportedModelError
        raise error(support.message)
    return support


def _quantization_verdict(hf_config: transformers.PretrainedConfig, task: Task,
                          quantization: str | None) -> str | None:
    """Rule 1's quantization part: a checkpoint format (or ``quantization`` option) the
    engine does not run, or quantized weights for the pooling engine, which has no
    quantized-linear step."""
    refused = quantization_refusal(hf_config, quantization)
    if refused is None and task == "embed" and (quantization or quantization_config_of(hf_config)):
        refused = "quantized weights run in the generation engine only (task 'generate'), not the pooling engine"
    return refused


def _config_verdict(hf_config: transformers.PretrainedConfig, task: Task) -> tuple[str, int | None] | None:
    """Rules 1 and 2: (reason, layer) from the config alone, or None."""
    refused = config_refusal(hf_config)
    if refused is not None:
        return refused, None
    unknown = unknown_layer_reason(hf_config)
    if unknown is not None:
        index, reason = unknown
        return reason, index
    if task == "embed":
        for index, layer_type in enumerate(declared_layer_types(hf_config)):
            if layer_type == "indexed_attention":
                return (f"layer {index} is an 'indexed_attention' layer, whose indexer picks each query's keys from "
                        "index keys the generation engine's paged cache keeps; the pooling engine's packed "
                        "forward keeps none"), index
            if layer_kind(hf_config, layer_type) not in _EMBED_KINDS or keeps_state(hf_config, layer_type):
                return (f"layer {index} is a {layer_type!r} layer, which the pooling engine cannot run: it packs "
                        "every prompt of a step into one sequence and keeps no per-request recurrent state, and "
                        "masks full and sliding-window attention only"), index
    return None


def _module_verdict(model: nn.Module, hf_config: transformers.PretrainedConfig,
                    task: Task) -> tuple[str | None, int | None]:
    """Rules 4 and 5 on the meta-device ``model``: (reason, layer), (None, None) if it runs."""
    if not routes_attention_interface(type(model), hf_config):
        return ("its attention does not go through transformers' AttentionInterface, so shardline's "
                "paged attention cannot run it"), None
    if task == "embed":
        if has_adapter(type(model)):
            return ("its attention runs on shardline through adapters that attend the paged KV cache, which "
                    "the pooling engine's packed forward does not use"), None
        recurrent = next((name for name, module in model.named_modules() if kind_for_module(module)), None)
        if recurrent is not None:
            return (f"its module {recurrent} keeps recurrent state, which the pooling engine (every prompt of a "
                    "step packed into one sequence) keeps no slot for"), None
        return None, None
    try:
        adapt_attention(model)
    except UnsupportedAttentionError as exc:
        return str(exc), None
    try:
        prepare_recurrent_layers(model, recurrent_layer_indices(hf_config))
    except UnsupportedLayerError as exc:
        return str(exc), None
    return None, None


def routes_attention_interface(model_class: type, hf_config: transformers.PretrainedConfig) -> bool:
    """Whether the model's attention layers call transformers' AttentionInterface, or
    are replaced by adapters that call the engine's paged attention (engine/model/adapters/)
    (true of a model without attention layers, such as a pure state-space model)."""
    if getattr(model_class, "_supports_attention_backend", False):
        return True
    if hf_config.model_type in UNDECLARED_ATTENTION_INTERFACE:
        return True
    if _modeling_file_calls_attention_interface(model_class) or has_adapter(model_class):
        return True
    if unknown_layer_reason(hf_config) is not None:
        return False
    kinds = {layer_kind(hf_config, layer_type) for layer_type in declared_layer_types(hf_config)}
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
