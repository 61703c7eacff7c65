"""The adapter base: an attention module transformers never routed through its
AttentionInterface, replaced by one that calls the engine's paged attention.

Invariants:
- An adapter takes over its original module's submodules and own parameters under
  the same names, so the state dict and LoRA target names see the same model; the
  original object is kept (unregistered) for its forward, with its own buffers (mask
  tables), which is why adapters are installed once the model is on its device.
- While a step of the engine runs (``StepScope`` holds its AttentionContext), the
  adapter computes queries, keys and values with the original's own projections and
  position encodings, attends through ``paged_attention_forward`` and applies the
  original's output projection, returning what the original returns. Outside a step
  (the load check's reference, a plain ``model(...)`` call) the original runs as is.
"""

from __future__ import annotations

import abc
import inspect
from typing import Any, TypeVar

import torch
from torch import nn

from ...attention.context import AttentionContext, paged_attention_forward
from ...attention.sparse_index import Selection


class UnsupportedAttentionError(ValueError):
    """An adapted module's configuration has no exact reference to run it by."""


_Value = TypeVar("_Value")


def layer_attribute(module: nn.Module, name: str, kind: type[_Value]) -> _Value:
    """``module.<name>``, an attribute a transformers attention module sets in its
    __init__ (a head count, a layer kind, its config), checked to be a ``kind``: the
    module's structure is only known at run time, so an adapter reads what it needs
    once, through this, into attributes of its own type."""
    value = getattr(module, name)
    if not isinstance(value, kind):
        raise UnsupportedAttentionError(
            f"{type(module).__name__}.{name} is {value!r}; its adapter reads a {kind.__name__} there")
    return value


def layer_flag(module: nn.Module, name: str) -> bool:
    """``module.<name>``, a switch the module tests for truth (a config flag), as a bool."""
    return bool(getattr(module, name))


def layer_scale(module: nn.Module, name: str) -> float:
    """``module.<name>``, a scale or a bound (an int or a float), as a float."""
    value = getattr(module, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UnsupportedAttentionError(
            f"{type(module).__name__}.{name} is {value!r}; its adapter reads a number there")
    return float(value)


class StepScope:
    """The AttentionContext of the step a model is running, for its adapters.

    transformers' older decoder layers do not pass the model's keyword arguments on
    to their attention modules, so the context cannot reach an adapter as an
    argument: a pre-hook on the model's forward puts it here and a forward hook
    clears it (``attach``), whatever the forward raised. A sparse attention's layers
    keep the step's last key selection here too (adapters/indexer.py), for the layers
    that reuse it."""

    def __init__(self) -> None:
        self.ctx: AttentionContext | None = None
        self.index_selections: list[Selection] | None = None

    def attach(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self._enter, with_kwargs=True)
        model.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.ctx = kwargs.get("shardline_ctx")
        self.index_selections = None

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.ctx = None
        self.index_selections = None


class _Replacement(nn.Module):
    """Takes over ``original``'s submodules and own parameters under their names and
    keeps the original (unregistered) to call its forward. ``layer_idx``: its KV-cache
    layer (None for a call-indexed module, whose calls name theirs)."""

    def __init__(self, original: nn.Module, layer_idx: int | None, scope: StepScope) -> None:
        super().__init__()
        for name, child in original.named_children():
            self.add_module(name, child)
        for name, parameter in original.named_parameters(recurse=False):
            self.register_parameter(name, parameter)
        self.layer_idx = layer_idx
        self._original = (original,)  # a tuple: not registered as a submodule
        self._scope = scope

    @property
    def original(self) -> nn.Module:
        """The original module, holding this one's current children: preparation steps
        after the adapters (quantized linears, LoRA layers, tensor-parallel splits)
        replace them here, where the original's own attributes would still name the
        modules they replaced."""
        original = self._original[0]
        for name, child in self.named_children():
            if getattr(original, name, None) is not child:
                setattr(original, name, child)
        return original


class ContextForwardingAttention(_Replacement):
    """An attention module that calls transformers' AttentionInterface, in a decoder
    layer that does not pass the model's keyword arguments on to it (stablelm): the
    step's context is added to its call."""

    def forward(self, *args, **kwargs):
        if self._scope.ctx is not None:
            kwargs.setdefault("shardline_ctx", self._scope.ctx)
        return self.original(*args, **kwargs)


# Forward arguments by which a caller names the cache layer of an attention call: the
# layer itself (zamba's and zamba2's shared block, which every hybrid layer calls), or
# an offset to the module's own layer index (the passes of a model that runs its layers
# several times per token: hrm_text's reasoning cycles, dory's loops).
CALL_LAYER_ARGUMENT = "layer_idx"
CALL_OFFSET_ARGUMENTS = ("cycle_offset", "cache_offset")


class CallIndexedAttention(ContextForwardingAttention):
    """An attention module that calls transformers' AttentionInterface and whose caller
    names the cache layer of each call (CALL_LAYER_ARGUMENT, CALL_OFFSET_ARGUMENTS):
    each call attends that layer of the paged cache (``shardline_layer_idx``), as
    transformers' own cache does, so a block several layers share, or a layer run in
    several passes, keeps one cache layer per call."""

    def __init__(self, original: nn.Module, layer_idx: int | None, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self._signature = inspect.signature(original.forward)
        parameters = self._signature.parameters
        self._offset = next((name for name in CALL_OFFSET_ARGUMENTS if name in parameters), None)

    def forward(self, *args, **kwargs):
        if self._scope.ctx is not None:
            call = self._signature.bind(*args, **kwargs)
            call.apply_defaults()
            if self._offset is not None:
                index = self.original.layer_idx + call.arguments[self._offset]
            else:
                index = call.arguments[CALL_LAYER_ARGUMENT]
            kwargs["shardline_layer_idx"] = index
        return super().forward(*args, **kwargs)


class PagedAttentionAdapter(_Replacement, abc.ABC):
    """Replaces one attention module (see the module docstring). A subclass says how
    its shape of attention makes queries, keys and values and how it returns:
    ``project`` and ``finish``; ``scale``, ``sliding_window``, ``alibi_slopes`` (or
    ``alibi_slopes_for``) and ``position_bias_for`` are the layer's attention options."""

    layer_idx: int
    scale: float
    sliding_window: int | None = None

    def __init__(self, original: nn.Module, layer_idx: int, scope: StepScope) -> None:
        super().__init__(original, layer_idx, scope)
        self.alibi_slopes: torch.Tensor | None = None
        self._signature = inspect.signature(original.forward)

    def forward(self, *args, **kwargs):
        ctx = self._scope.ctx
        if ctx is None:
            return self.original(*args, **kwargs)
        call = self._signature.bind(*args, **kwargs).arguments
        hidden_states = call["hidden_states"] if "hidden_states" in call else next(iter(call.values()))
        assert hidden_states.shape[0] == 1, "the engine runs one packed sequence"
        query, key, value = self.project(hidden_states[0], call)  # [T, H, D], [T, Hkv, D], [T, Hkv, Dv]
        key, value = _to_cache_heads(key, value, ctx, self.layer_idx)
        out, _ = paged_attention_forward(
            self, query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], None,
            scaling=self.scale, sliding_window=self.sliding_window, shardline_ctx=ctx,
            alibi_slopes=self.alibi_slopes_for(call), position_bias=self.position_bias_for(call, query))
        return self.finish(out[0].flatten(1)[None], call)  # out: [1, T, H, Dv] -> [1, T, H * Dv]

    def alibi_slopes_for(self, call: dict) -> torch.Tensor | None:
        """[H] ALiBi slopes of this call (None: no ALiBi)."""
        return self.alibi_slopes

    @property
    def uses_position_bias(self) -> bool:
        """Whether this layer attends with a bias table by key position (position_bias_for),
        which only the torch attention path takes."""
        return False

    def position_bias_for(self, call: dict, query: torch.Tensor) -> torch.Tensor | None:
        """[H, L] this call's bias table by key position, covering the step's contexts,
        in ``query``'s dtype and device (AttentionOptions.position_bias; None: none)."""
        return None

    @abc.abstractmethod
    def project(self, hidden_states: torch.Tensor, call: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states: [T, hidden] -> query [T, H, D], key [T, Hkv, D], value [T, Hkv, Dv]."""

    @abc.abstractmethod
    def finish(self, attention: torch.Tensor, call: dict):
        """attention: [1, T, H * Dv] -> what the original module returns."""


def _to_cache_heads(key: torch.Tensor, value: torch.Tensor, ctx: AttentionContext,
                    layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values with as many heads as the layer's cache: a model whose config
    does not name its key-value heads (falcon's multi-query) is cached with one per
    query head, each key-value head repeated over its group, which attends the same."""
    cache_heads = ctx.kv_caches[layer_idx][0].shape[2]
    if key.shape[1] == cache_heads:
        return key, value
    group = cache_heads // key.shape[1]
    return key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
