"""A Llama-family decoder's forward on the CPU path, without transformers' per-call plumbing.

transformers' decoder forward (LlamaModel and its kin) runs, on every step and before
any layer, its decorators (keyword defaults from the config, output capturing), a
causal-mask builder whose answer for the engine's attention is always "no mask", and
a slice of its layer list (a new ModuleList each call). On a small model's decode step
that is a measurable share of the step. ``FusedDecoder`` runs the same parts in the
same order (embedding, rotary tables, every layer, final norm) for the engine's own
steps, and the original forward for anything else.

Invariants:
- The replacement holds the decoder's own submodules under the same names, so every
  parameter, buffer and submodule keeps its path; the original decoder is kept
  unregistered for the calls it does not take, and is given back any of those
  submodules replaced since (surgery on the model reaches the replacement only).
- It is put in place only for a decoder whose every layer is a FusedDecoderLayer, and
  only where it gives the decoder's own output on a probe step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from types import MethodType
from typing import Any, cast

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..attention.context import AttentionContext
from ..surgery import Comparison, probe_matches, replace
from .decode_programs import DecodePrograms
from .probe import PROBE_TOKENS, probe_cache, probe_context, probe_positions
from .protocols import LlamaAttention

logger = logging.getLogger(__name__)

# Decoder classes whose forward is embedding, rotary tables, layers, final norm.
DECODER_CLASSES = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


class FusedDecoder(nn.Module):
    """The decoder's forward for an engine step (see the module docstring); other calls
    (a mask, a cache, extra keywords, gradients) go to the original's."""

    embed_tokens: nn.Module  # the decoder's own parts, registered here under their names
    layers: nn.ModuleList
    norm: nn.Module
    rotary_emb: nn.Module

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        for name in PARTS:
            self.add_module(name, decoder.get_submodule(name))
        self.__dict__["original"] = decoder  # not a submodule: the parts above are its own
        self.num_layers = len(self.layers)
        self.programs: DecodePrograms | None = None  # see record_decode_steps

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # what callers read of the decoder (config, padding_idx, ...)
            if "original" not in self.__dict__:  # during __init__
                raise
            original = self.__dict__["original"]
            value = getattr(original, name)
            if isinstance(value, MethodType) and value.__self__ is original:
                # Its methods (get_decoder, get_input_embeddings, ...) run on this module,
                # whose parts are the ones in use.
                return MethodType(value.__func__, self)
            return value

    @property
    def base_model(self) -> nn.Module:  # the original's property would answer the original
        return self

    def get_decoder(self) -> nn.Module:
        return self

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: object = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                shardline_ctx: AttentionContext | None = None, **kwargs: Any) -> BaseModelOutputWithPast:
        # input_ids: [1, T] (or inputs_embeds [1, T, hidden]) -> last_hidden_state [1, T, hidden]
        if (kwargs or attention_mask is not None or cache is not None or use_cache or position_ids is None
                or shardline_ctx is None or (input_ids is None) == (inputs_embeds is None)
                or torch.is_grad_enabled()):
            return self._original_forward(input_ids=input_ids, attention_mask=attention_mask,
                                          position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                                          use_cache=use_cache, shardline_ctx=shardline_ctx, **kwargs)
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        assert len(self.layers) == self.num_layers, "the decoder's layers changed after it was fused"
        run_layers = partial(self._run_layers, position_ids=position_ids, use_cache=use_cache, ctx=shardline_ctx)
        programs = self.programs
        out = None if programs is None else programs.forward(hidden, position_embeddings, run_layers, shardline_ctx)
        if out is None:
            out = run_layers(hidden, position_embeddings)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(out), cache=None)

    def _run_layers(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                    position_ids: torch.Tensor, use_cache: bool | None, ctx: AttentionContext) -> torch.Tensor:
        for layer in self.layers:  # the keywords transformers' loop passes
            hidden = layer(hidden, attention_mask=None, position_embeddings=position_embeddings,
                           position_ids=position_ids, cache=None, use_cache=use_cache, shardline_ctx=ctx)
        return hidden

    def record_decode_steps(self) -> None:
        """Replay this decoder's decode steps from recorded kernel calls (cpu/decode_programs.py)."""
        self.programs = DecodePrograms(self.layers)

    def _original_forward(self, **kwargs: Any) -> BaseModelOutputWithPast:
        original = self.__dict__["original"]
        for name in PARTS:  # a part replaced on this module since
            if original._modules[name] is not self._modules[name]:
                original._modules[name] = self._modules[name]
        return original(**kwargs)


def _fits(decoder: nn.Module, is_fused_layer: Callable[[nn.Module], bool]) -> bool:
    """A decoder of the known classes with exactly the four parts, no weights of its own,
    and every layer fused."""
    layers = decoder._modules.get("layers")
    return (type(decoder).__name__ in DECODER_CLASSES and set(decoder._modules) == set(PARTS)
            and not decoder._parameters and not decoder._buffers and isinstance(layers, nn.ModuleList)
            and len(layers) > 0 and all(is_fused_layer(layer) for layer in layers)
            and getattr(decoder.config, "num_hidden_layers", None) == len(layers))


def _probe_decoder(decoder: nn.Module, layers: nn.ModuleList, dtype: torch.dtype) -> torch.Tensor:
    """``decoder``'s last hidden state for the probe request (cpu/probe.py), from seeded
    random token ids."""
    attentions = [cast(LlamaAttention, layer.get_submodule("layer.self_attn")) for layer in layers]
    caches = [probe_cache(attention.k_proj.out_features // attention.head_dim, attention.head_dim, dtype)
              for attention in attentions]
    ctx = probe_context(caches, attentions[0].q_proj.out_features // attentions[0].head_dim)
    vocab_size = cast(nn.Embedding, decoder.get_submodule("embed_tokens")).num_embeddings
    input_ids = torch.randint(3, vocab_size, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    return decoder(input_ids=input_ids, position_ids=probe_positions(), use_cache=False,
                   shardline_ctx=ctx).last_hidden_state


def fuse_decoders(model: nn.Module, is_fused_layer: Callable[[nn.Module], bool], same: Comparison) -> int:
    """Replace every Llama-family decoder whose layers are all fused (``is_fused_layer``:
    engine/cpu/layers.py's FusedDecoderLayer) by a FusedDecoder where that gives the
    decoder's own output on a probe step (``same``); returns how many."""
    replaced = 0
    for name, decoder in list(model.named_modules()):
        if not name or not _fits(decoder, is_fused_layer):
            continue
        layers = decoder._modules["layers"]
        assert isinstance(layers, nn.ModuleList)
        norm_weight = getattr(decoder._modules["norm"], "weight", None)
        if not isinstance(norm_weight, torch.Tensor):
            continue
        fused = FusedDecoder(decoder)
        probe = partial(_probe_decoder, layers=layers, dtype=norm_weight.dtype)
        if not probe_matches(decoder, fused, probe, same):
            logger.info("%s does not match the fused decoder forward; it keeps its own", type(decoder).__name__)
            continue
        replace(model, name, fused)
        replaced += 1
    return replaced


def record_decode_steps(model: nn.Module) -> int:
    """Replay the decode steps of every FusedDecoder in ``model`` from recorded kernel
    calls (cpu/decode_programs.py); returns how many decoders."""
    decoders = [module for module in model.modules() if isinstance(module, FusedDecoder)]
    for decoder in decoders:
        decoder.record_decode_steps()
    return len(decoders)
