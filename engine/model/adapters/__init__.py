"""Attention adapters: architectures whose transformers code never calls its
AttentionInterface run on the engine's paged attention by having their attention
modules replaced (engine/model/adapters/shapes.py, one adapter per attention shape).

``adapt_attention`` replaces them in a loaded model (one entry point); ``has_adapter``
tells the loader's pre-flight check that an architecture will be adapted. The load
check (engine/model/load_check.py) then compares the adapted model's paged path with
its own forward, as for every model.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn
from transformers import PretrainedConfig

from ...surgery import decoder_layers, replace
from .base import (
    CALL_LAYER_ARGUMENT,
    CALL_OFFSET_ARGUMENTS,
    CallIndexedAttention,
    ContextForwardingAttention,
    PagedAttentionAdapter,
    StepScope,
)
from .deepseek_v4 import CompressedAttention
from .inkling import InklingAttention, PagedShortConv
from .inkling2 import DynamicShortConv, EagerDepthAttention, Inkling2Attention, ScaledShortConv
from .latent import latent_adapter_keys, latent_caching
from .qwen4_exp import QuerySparseAttention
from .shapes import (
    BloomAttention,
    DiffLlamaAttention,
    FalconAttention,
    GPTNeoAttention,
    GPTNeoXJapaneseAttention,
    MptAttention,
    OpenAIGPTAttention,
    XGLMAttention,
)

_MODELS = "transformers.models."
# transformers' attention class (modeling module and name) -> its adapter.
ADAPTERS: dict[str, type[PagedAttentionAdapter] | type[CompressedAttention] | type[InklingAttention]
               | type[PagedShortConv] | type[QuerySparseAttention] | type[Inkling2Attention]] = {
    _MODELS + "gpt_neo.modeling_gpt_neo.GPTNeoSelfAttention": GPTNeoAttention,
    _MODELS + "xglm.modeling_xglm.XGLMAttention": XGLMAttention,
    _MODELS + "openai.modeling_openai.Attention": OpenAIGPTAttention,
    _MODELS + "gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention": GPTNeoXJapaneseAttention,
    _MODELS + "falcon.modeling_falcon.FalconAttention": FalconAttention,
    _MODELS + "bloom.modeling_bloom.BloomAttention": BloomAttention,
    _MODELS + "mpt.modeling_mpt.MptAttention": MptAttention,
    _MODELS + "diffllama.modeling_diffllama.DiffLlamaAttention": DiffLlamaAttention,
    _MODELS + "inkling.modeling_inkling.InklingAttention": InklingAttention,
    _MODELS + "inkling.modeling_inkling.InklingShortConvolution": PagedShortConv,
    **{f"{_MODELS}{name}.modeling_{name}.{prefix}{kind}": adapter
       for name, prefix in (("inkling2", "Inkling2"), ("inkling2_loop", "Inkling2Loop"))
       for kind, adapter in (("SlidingAttention", Inkling2Attention), ("FullAttention", Inkling2Attention),
                             ("ShortConvolution", ScaledShortConv), ("DynamicShortConvolution", DynamicShortConv))},
    _MODELS + "deepseek_v4.modeling_deepseek_v4.DeepseekV4Attention": CompressedAttention,
    _MODELS + "qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextAttention": QuerySparseAttention,
}
# Attention over depth (a token's earlier layer outputs, nothing cached), anywhere in the
# model: run by transformers' eager attention, not the paged one.
DEPTH_ADAPTERS = {
    f"{_MODELS}{name}.modeling_{name}.{prefix}{kind}": EagerDepthAttention
    for name, prefix in (("inkling2", "Inkling2"), ("inkling2_loop", "Inkling2Loop"))
    for kind in ("BlockAttentionResidual", "MessageAttentionResidual")}
# Attention classes of models whose layers cache latents (adapters/latent.py), adapted
# where caches_latents says their cache holds latents.
LATENT_ADAPTERS = latent_adapter_keys()


def _key(module_class: type) -> str:
    return f"{module_class.__module__}.{module_class.__qualname__}"


def has_adapter(model_class: type) -> bool:
    """Whether the model class's modeling file has an attention class with an adapter."""
    prefix = model_class.__module__ + "."
    return any(key.startswith(prefix) for key in ADAPTERS)


@functools.cache
def _calls_attention_interface(module_class: type) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS.get_interface" in inspect.getsource(module_class.forward)
    except (OSError, TypeError):
        return False


@functools.cache
def _call_indexed(module_class: type) -> bool:
    """Whether the module calls the AttentionInterface and its caller names each call's
    cache layer (CallIndexedAttention)."""
    try:
        parameters = inspect.signature(module_class.forward).parameters
    except (TypeError, ValueError):
        return False
    names = (CALL_LAYER_ARGUMENT, *CALL_OFFSET_ARGUMENTS)
    return _calls_attention_interface(module_class) and any(name in parameters for name in names)


@functools.cache
def _passes_keywords(layer_class: type, name: str) -> bool:
    """Whether ``layer_class``'s forward passes its keyword arguments on (``**kwargs``)
    where it calls its submodule ``name`` (a direct child); read from its source."""
    try:
        source = inspect.getsource(layer_class.forward)
    except (OSError, TypeError):
        return False
    start = source.find(f"self.{name}(")
    if start < 0 or "." in name:
        return False
    depth, end = 0, start + len(name) + 5
    for end in range(start + len(name) + 5, len(source)):  # to the call's closing parenthesis
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        if depth == 0:
            break
    return "**kwargs" in source[start:end]


def adapt_attention(model: nn.Module) -> int:
    """Replace every attention module of ``model`` that has an adapter; wrap each
    module calling the AttentionInterface whose caller names each call's cache layer
    (CallIndexedAttention: zamba's shared block, hrm_text's and dory's repeated passes)
    or whose decoder layer does not pass the model's keyword arguments on to it
    (stablelm, nemotron), so the step's context reaches it; return how many. Each
    one's layer index is its decoder layer's (surgery.decoder_layers), which is
    also its KV-cache layer, except a call-indexed module's, whose calls name theirs;
    those are found anywhere in the model (hrm_text has two stacks of layers), a
    module shared by several layers once, as is attention over depth (DEPTH_ADAPTERS).
    A module with an adapter of its own is adapted, not wrapped. Every replacement goes through
    surgery.replace; on a model already adapted nothing is replaced again (an adapter
    keeps its original unregistered, so it is not found a second time)."""
    scope = StepScope()
    replaced = 0
    for name, module in list(model.named_modules()):
        if not name:
            continue
        if _key(type(module)) in DEPTH_ADAPTERS:
            replace(model, name, DEPTH_ADAPTERS[_key(type(module))](module, None, scope))
            replaced += 1
        elif _call_indexed(type(module)) and _key(type(module)) not in ADAPTERS:
            replace(model, name, CallIndexedAttention(module, getattr(module, "layer_idx", None), scope))
            replaced += 1
    layers_name, layers = decoder_layers(model)
    config = getattr(model, "config", None)
    latent = isinstance(config, PretrainedConfig) and latent_caching(config.get_text_config())
    for index, layer in enumerate(layers):
        for name, module in list(layer.named_modules()):
            adapter = ADAPTERS.get(_key(type(module))) or (LATENT_ADAPTERS.get(_key(type(module))) if latent else None)
            if (adapter is None and name and _calls_attention_interface(type(module))
                    and not _passes_keywords(type(layer), name)):
                adapter = ContextForwardingAttention
            if adapter is not None:
                replace(model, ".".join(filter(None, (layers_name, str(index), name))), adapter(module, index, scope))
                replaced += 1
    if replaced:
        scope.attach(model)
    return replaced
