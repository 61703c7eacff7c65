"""Recurrent layers in the engine: the HF mixers replaced by a wrapper that runs
their kind over the packed batch, and the per-slot state tensors they read and write.

At load, ``install_recurrent_layers`` replaces every Hugging Face module whose class
has a registered kind (engine/recurrent/base.py) by a ``RecurrentLayer``, through
engine/surgery.py's ``replace``. Each step the runner passes a ``RecurrentStep`` to
the model as the keyword ``shardline_state`` beside the attention context
``shardline_ctx``: the requests' state slots and whether each continues a saved
state. Decoder layers that do not hand their keyword arguments on to their mixers
(Mamba's) are reached through a ``StepHolder``: hooks on the model keep the call's
two keywords there for the duration of the forward. The wrapper gathers the slots'
states, runs its kind and scatters the updated states back, so kinds never see slots.

Without a ``shardline_state`` the wrapper runs either the HF module itself (no
``shardline_ctx`` either: the model's own forward, as the load check's reference
runs it) or its kind from zero state with nothing kept (a forward the engine only
measures, e.g. memory profiling).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from ..errors import UnsupportedLayerError
from ..surgery import decoder_layers, replace
from .base import RecurrentKind, StateShapes, kind_for_module, registered_module_classes


@dataclass(frozen=True)
class RecurrentStep:
    """The step's requests' recurrent state: their slots and where they start."""

    slots: torch.Tensor  # [B] int64, in batch order
    has_initial_state: torch.Tensor  # [B] bool: False where a request computes from token 0
    # Per recurrent layer index: state name -> [num_slots, *shape] (the runner's tensors).
    states: dict[int, dict[str, torch.Tensor]]
    # [B] int64: how many of each request's scheduled tokens lie in its prompt (the
    # rest are generated tokens), for kinds whose math differs between the two (a
    # kind's ``reads_prompt_tokens``); None: such kinds follow their module's branches.
    num_prompt_tokens: torch.Tensor | None = None

    @functools.cached_property
    def slot_range(self) -> tuple[int, torch.Tensor | None] | None:
        """On a CPU step whose slots are s, s+1, ..., s+B-1 in some order: (s, the batch
        order that sorts them, or None where the batch is already in slot order). The
        layers then run on views of the slot tensors, with no gather or scatter of the
        states. None on other steps."""
        if self.slots.device.type != "cpu" or self.slots.numel() == 0:
            return None
        ordered, order = torch.sort(self.slots)
        first = int(ordered[0])
        if not torch.equal(ordered, torch.arange(first, first + ordered.numel())):
            return None
        return first, None if torch.equal(ordered, self.slots) else order


class StepHolder:
    """The engine keywords of the model forward in progress (None outside one)."""

    def __init__(self) -> None:
        self.ctx = None
        self.state: RecurrentStep | None = None

    def hold(self, module: nn.Module, args, kwargs) -> None:
        self.ctx = kwargs.get("shardline_ctx")
        self.state = kwargs.get("shardline_state")

    def release(self, *unused) -> None:
        self.ctx = self.state = None


class RecurrentLayer(nn.Module):
    """Runs ``layer`` (an HF recurrent mixer) through its kind over the packed batch."""

    def __init__(self, layer: nn.Module, kind: RecurrentKind, layer_idx: int, hf_config: PretrainedConfig,
                 holder: StepHolder | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.kind = kind
        self.layer_idx = layer_idx
        self.hf_config = hf_config
        self.holder = holder or StepHolder()

    def state_shapes(self) -> StateShapes:
        return self.kind.state_shapes(self.layer, self.hf_config)

    def forward(self, hidden_states: torch.Tensor, *args, shardline_ctx=None,
                shardline_state: RecurrentStep | None = None, **kwargs):
        shardline_ctx = shardline_ctx if shardline_ctx is not None else self.holder.ctx
        shardline_state = shardline_state if shardline_state is not None else self.holder.state
        if shardline_ctx is None and shardline_state is None:
            return self.layer(hidden_states, *args, **kwargs)
        output = self._run(hidden_states, shardline_ctx, shardline_state)
        # What the HF module returns (a tuple where the decoder layer unpacks one).
        return self.kind.module_output(self.layer, output)

    def _run(self, hidden_states: torch.Tensor, shardline_ctx, shardline_state: RecurrentStep | None
             ) -> torch.Tensor:
        # hidden_states: [1, T, hidden], the packed batch
        cu_seqlens = shardline_ctx.query_start_loc
        if shardline_state is None:
            num_requests = cu_seqlens.shape[0] - 1
            states = {name: torch.zeros((num_requests, *shape), dtype=dtype, device=hidden_states.device)
                      for name, (shape, dtype) in self.state_shapes().items()}
            fresh = torch.zeros(num_requests, dtype=torch.bool, device=hidden_states.device)
            return self.kind.forward(self.layer, hidden_states[0], cu_seqlens, fresh, states).unsqueeze(0)
        slot_states = shardline_state.states[self.layer_idx]
        slots, slot_range = shardline_state.slots, shardline_state.slot_range
        if slot_range is None:  # gather the step's states, run, scatter them back
            states = {name: tensor.index_select(0, slots) for name, tensor in slot_states.items()}
            output = self.kind.forward(self.layer, hidden_states[0], cu_seqlens,
                                       shardline_state.has_initial_state, states,
                                       **self._prompt_tokens(shardline_state, None))
            for name, tensor in slot_states.items():
                tensor.index_copy_(0, slots, states[name])
            return output.unsqueeze(0)
        # The kind updates a view of the slot tensors in place, its requests in slot order.
        first, order = slot_range
        states = {name: tensor.narrow(0, first, slots.numel()) for name, tensor in slot_states.items()}
        if order is None:
            return self.kind.forward(self.layer, hidden_states[0], cu_seqlens, shardline_state.has_initial_state,
                                     states, **self._prompt_tokens(shardline_state, None)).unsqueeze(0)
        tokens, ordered_cu_seqlens = _reorder_requests(cu_seqlens, order)
        ordered = self.kind.forward(self.layer, hidden_states[0].index_select(0, tokens), ordered_cu_seqlens,
                                    shardline_state.has_initial_state[order], states,
                                    **self._prompt_tokens(shardline_state, order))
        output = torch.empty_like(ordered)
        output[tokens] = ordered
        return output.unsqueeze(0)

    def _prompt_tokens(self, step: RecurrentStep, order: torch.Tensor | None) -> dict:
        """``num_prompt_tokens`` for a kind that reads it (its ``reads_prompt_tokens``),
        in the order its requests run; no keyword for the others."""
        if not self.kind.reads_prompt_tokens or step.num_prompt_tokens is None:
            return {}
        counts = step.num_prompt_tokens
        return {"num_prompt_tokens": counts if order is None else counts[order]}


def _reorder_requests(cu_seqlens: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed batch with its requests in ``order``: (each new position's token in the
    old packing [T], the new cu_seqlens [B+1])."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1])[order]
    ordered_cu_seqlens = torch.zeros_like(cu_seqlens)
    torch.cumsum(lengths, 0, out=ordered_cu_seqlens[1:])
    num_tokens = int(cu_seqlens[-1])
    shift = torch.repeat_interleave(cu_seqlens[:-1][order] - ordered_cu_seqlens[:-1], lengths, output_size=num_tokens)
    return torch.arange(num_tokens, device=cu_seqlens.device) + shift, ordered_cu_seqlens


def install_recurrent_layers(model: nn.Module) -> dict[int, RecurrentLayer]:
    """Replace each HF module with a registered kind by a RecurrentLayer (through
    surgery.replace); return them by layer index: the module's ``layer_idx``, else the
    position of the decoder layer holding it (surgery.decoder_layers). A module inside
    one replaced runs as part of it, so it is not replaced itself."""
    installed: dict[int, RecurrentLayer] = {}
    text_config = _text_config(model)
    holder = StepHolder()
    layer_of = {id(module): index for index, layer in enumerate(decoder_layers(model)[1]) for module in layer.modules()}
    replaced: list[str] = []
    for kind in {id(kind): kind for kind in map(kind_for_module, model.modules()) if kind is not None}.values():
        kind.prepare_model(model)
    for name, module in list(model.named_modules()):
        kind = kind_for_module(module)
        if kind is None or not name or any(name.startswith(outer + ".") for outer in replaced):
            continue
        layer_idx = getattr(module, "layer_idx", None)
        layer_idx = layer_idx if isinstance(layer_idx, int) else layer_of.get(id(module))
        assert layer_idx is not None, f"{type(module).__name__} is in no decoder layer"
        wrapper = RecurrentLayer(module, kind, layer_idx, text_config, holder)
        replace(model, name, wrapper)
        replaced.append(name)
        installed[layer_idx] = wrapper
    if installed:
        model.register_forward_pre_hook(holder.hold, with_kwargs=True)
        model.register_forward_hook(holder.release, always_call=True)
    return installed


def _text_config(model: nn.Module) -> PretrainedConfig:
    """The text part of a transformers model's config (``model.config``)."""
    config = model.config
    assert isinstance(config, PretrainedConfig), f"{type(model).__name__} has no transformers config"
    return config.get_text_config()


@dataclass(frozen=True)
class RecurrentStateSpec:
    """Each recurrent layer's per-request state tensors (shapes without the slot dimension)."""

    layers: dict[int, StateShapes]

    @classmethod
    def from_layers(cls, layers: dict[int, RecurrentLayer]) -> RecurrentStateSpec:
        return cls({index: layer.state_shapes() for index, layer in sorted(layers.items())})

    @property
    def is_empty(self) -> bool:
        return not self.layers

    def bytes_per_slot(self) -> int:
        total = 0
        for shapes in self.layers.values():
            for shape, dtype in shapes.values():
                total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return total

    def allocate(self, num_slots: int, device: torch.device) -> dict[int, dict[str, torch.Tensor]]:
        """Each layer's state tensors [num_slots, *shape], zeroed."""
        return {index: {name: torch.zeros((num_slots, *shape), dtype=dtype, device=device)
                        for name, (shape, dtype) in shapes.items()}
                for index, shapes in self.layers.items()}


def prepare_recurrent_layers(model: nn.Module, recurrent_layers: list[int]) -> RecurrentStateSpec | None:
    """Install the wrappers (``install_recurrent_layers``) and return the state spec, or
    None when the model has no recurrent layer. ``recurrent_layers``: the layer indices
    the cache spec marks recurrent; each must have got a wrapper, else the model is
    refused naming the first that did not (its layer type is registered for the model
    type, but none of its modules is of a registered class)."""
    installed = install_recurrent_layers(model)
    missing = sorted(set(recurrent_layers) - set(installed))
    if missing:
        raise UnsupportedLayerError(
            f"{type(model).__name__} layer {missing[0]} is a recurrent layer, but none of its modules is of a "
            f"class shardline runs ({', '.join(registered_module_classes())})")
    return RecurrentStateSpec.from_layers(installed) if installed else None
