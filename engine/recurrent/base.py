"""The contract between the engine and a recurrent layer kind.

A recurrent layer (gated delta-net, Mamba, short convolution, linear attention...)
keeps per-request state that is not a KV cache. The engine owns that state: each
running request holds a slot in per-layer state tensors, and before a layer runs the
engine gathers the step's requests' states from their slots (and scatters them back
after). A layer kind therefore never sees slots, blocks or the scheduler; it sees the
step's packed batch and the gathered states:

- ``hidden_states`` [T, hidden]: all scheduled tokens of all requests, packed as
  StepBatch (engine/attention/context.py) lays them out;
- ``cu_seqlens`` [B+1] int64: request b's tokens are hidden_states[cu_seqlens[b]:cu_seqlens[b+1]]
  (StepBatch.query_start_loc);
- ``has_initial_state`` [B] bool: False for a request's first chunk (start from zero
  state), True when it continues from the state its previous step left;
- ``states[name]`` [B, *shape]: the gathered state of each request in batch order,
  shapes as ``state_shapes`` declares them. ``forward`` reads them where
  has_initial_state is True and writes, in place, the state after each request's
  last scheduled token.

Invariants: ``forward`` is exact for any split of a request's tokens into chunks
(chunk boundaries never change the output); it runs a chunk of many tokens without a
per-token Python loop where the math allows, and single-token decode.

Kinds are registered by the Hugging Face module class they replace (e.g.
"Qwen3NextGatedDeltaNet"), and by the (model type, config ``layer_types`` name) pairs
that mark a layer of that kind (e.g. ("qwen3_next", "linear_attention")), so a config
is accepted or refused before weights load: many model types call different layer
kinds "linear_attention", so the name alone says nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

# name -> (shape without the slot dimension, dtype)
StateShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def projection_weight(projection: torch.nn.Module) -> torch.Tensor:
    """A projection's ``weight`` (whose dtype a kind's state takes), whatever module holds
    the projection (a linear layer, or what LoRA and the CPU paths put in its place)."""
    weight = projection.weight
    assert isinstance(weight, torch.Tensor), f"{type(projection).__name__} has no weight tensor"
    return weight


def projection_out_features(projection: torch.nn.Module) -> int:
    """A linear projection's ``out_features``, whatever module holds the projection."""
    out_features = projection.out_features
    assert isinstance(out_features, int), f"{type(projection).__name__} has no out_features"
    return out_features


class RecurrentKind(ABC):
    """One kind of recurrent layer: what state a request keeps, and how a step runs.

    A kind declares ``name`` and implements ``state_shapes`` and ``forward``; the other
    members have the defaults below, which a kind overrides where its layer differs.
    """

    name: ClassVar[str]
    # The dtype the HF module's own code computes this layer in when narrower than the
    # model's (e.g. float32 for a float64 model); the load check compares at that dtype's
    # tolerance. None: the model's dtype.
    reference_dtype: ClassVar[torch.dtype | None] = None
    # True where the HF decoder layer unpacks (output, state) from this mixer.
    returns_tuple: ClassVar[bool] = False
    # True where ``forward`` also takes ``num_prompt_tokens`` [B] (how many of each
    # request's tokens are prompt tokens), for math that generate runs differently on
    # prompt and generated tokens (Mamba-2's time-step floor).
    reads_prompt_tokens: ClassVar[bool] = False
    # True where the kind can run its core through the CPU recurrent kernel
    # (engine/kernels/cpu_recurrent.py); the engine's CPU paths then construct it with
    # ``native_core=True`` once they have chosen the kernel (engine/cpu/recurrent_core.py).
    has_native_core: ClassVar[bool] = False

    def __init__(self, native_core: bool = False) -> None:
        if native_core and not self.has_native_core:
            raise ValueError(f"recurrent kind {self.name!r} has no native core; native_core=True is accepted "
                             f"only by kinds whose has_native_core is True")
        # Whether the core runs through the CPU kernel where it takes the step's tensors.
        self.native_core = native_core

    def prepare_model(self, model: torch.nn.Module) -> None:  # noqa: B027 - optional, nothing by default
        """Ready the loaded model, once, before this kind's modules in it are wrapped
        (default: nothing): for a model whose own forward reaches into the modules the
        kind replaces (RWKV's rescaling of its blocks' weights)."""

    def decode_differs_from_scan(self, hf_module: torch.nn.Module) -> bool:
        """Whether the HF module's own one-token update computes a token otherwise than
        its chunked scan would (Mamba-2's floor on the time step applies in the scan
        only); the load check then takes generate's path as its reference."""
        return False

    def module_output(self, hf_module: torch.nn.Module, output: torch.Tensor
                      ) -> torch.Tensor | tuple[torch.Tensor | None, ...]:
        """What the replaced HF module returns, from ``forward``'s output [1, T, hidden]:
        the output itself, or (output, None) where the decoder layer unpacks a tuple. A
        kind whose module returns several tensors packs them in one and unpacks them here."""
        return (output, None) if self.returns_tuple else output

    @abstractmethod
    def state_shapes(self, hf_module: torch.nn.Module, hf_config) -> StateShapes:
        """Per-request state tensors of this layer, shapes without the slot dimension."""

    @abstractmethod
    def forward(
        self,
        hf_module: torch.nn.Module,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        has_initial_state: torch.Tensor,
        states: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """hidden_states: [T, hidden]; returns the layer's output [T, hidden] (what the
        HF module returns, without its batch dimension). Updates ``states`` in place."""


# Deliberate per-process registries, filled at import of each kind's module.
_BY_MODULE_CLASS: dict[str, RecurrentKind] = {}
_BY_LAYER_TYPE: dict[tuple[str, str], RecurrentKind] = {}


def register_kind(kind: RecurrentKind, module_classes: tuple[str, ...], model_types: tuple[str, ...] = (),
                  layer_types: tuple[str, ...] = ()) -> RecurrentKind:
    """Register ``kind`` for the HF module classes it replaces and, for each of
    ``model_types``, the config layer_types names that mark it (idempotent); return it."""
    for name in module_classes:
        _BY_MODULE_CLASS[name] = kind
    for model_type in model_types:
        for layer_type in layer_types:
            _BY_LAYER_TYPE[(model_type, layer_type)] = kind
    return kind


def kind_for_module(module: torch.nn.Module) -> RecurrentKind | None:
    """The kind registered for this HF module's class, or None."""
    return _BY_MODULE_CLASS.get(type(module).__name__)


def kind_for_layer_type(model_type: str, layer_type: str) -> RecurrentKind | None:
    """The kind registered for a config layer_types entry of ``model_type``, or None."""
    return _BY_LAYER_TYPE.get((model_type, layer_type))


def registered_kinds() -> tuple[RecurrentKind, ...]:
    """Every registered kind, once each, by name."""
    kinds = {id(kind): kind for kind in (*_BY_MODULE_CLASS.values(), *_BY_LAYER_TYPE.values())}
    return tuple(sorted(kinds.values(), key=lambda kind: kind.name))


def registered_module_classes() -> tuple[str, ...]:
    return tuple(sorted(_BY_MODULE_CLASS))


def recurrent_model_types() -> tuple[str, ...]:
    """Model types with a registered recurrent layer kind."""
    return tuple(sorted({model_type for model_type, _ in _BY_LAYER_TYPE}))
