"""Batched LoRA layers: each token of one packed forward uses its own adapter, or none.

Every adaptable linear layer (nn.Linear, GPT-2's Conv1D or a QuantizedLinear, whose
weight stays quantized while the delta is added on top; except the output
embeddings) is wrapped once, when the LoRAManager is built, so the memory for all
adapter slots is taken before the KV cache is sized. A wrapper holds the adapters
of all slots stacked and zero-padded to max_lora_rank:

    lora_a: [max_loras, max_lora_rank, in_features]
    lora_b: [max_loras, out_features, max_lora_rank]   (already multiplied by scaling)

and computes, for the tokens of each slot s in use this step,

    y[rows_s] = base(x)[rows_s] + (x[rows_s] @ A_s[:r_s].T) @ B_s[:, :r_s].T

with one pair of matmuls per slot in use (at most max_loras), never a loop over
tokens. Tokens of no slot are left as the base layer computed them, bit for bit, and
with no slot in use the wrapper adds nothing at all. Which rows belong to which slot
is decided once per step by the manager in a LoRATokenGroups object that every
wrapper shares (an explicit context object, not a module global).

On a tensor-parallel rank a layer may be its rank's share of the whole layer an
adapter was trained for (its ``LayerShare``, set by engine/parallel/): a slot then
holds the matching part of the adapter, B's rows of a column share (A whole), A's
columns of a row share (B whole, the partial deltas summed with the base layer's
partial products, so the delta is added once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..quantization.linear import QuantizedLinear
from ..surgery import replace, submodule


@dataclass
class LoRATokenGroups:
    """The packed tokens of the next forward, grouped by adapter slot.

    Invariants: the slots in ``groups`` are distinct and hold an adapter; ``rows``
    are indices into the flattened tokens [num_tokens] (None: every token); tokens
    in no group use no adapter.
    """

    num_tokens: int = 0
    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


@dataclass(frozen=True)
class LayerShare:
    """How a layer relates to the whole layer of (``in_features``, ``out_features``)
    an adapter was trained for: it computes output ``rows`` of the whole layer's, or
    takes input ``columns`` of its input (None: all of them). ``named_by_parent``: the
    adapter names it by its parent module's name (a row share's inner linear)."""

    in_features: int
    out_features: int
    rows: torch.Tensor | slice | None = None
    columns: torch.Tensor | slice | None = None
    named_by_parent: bool = False


# The attribute of a layer holding its LayerShare, where it is a share of a whole layer.
SHARE_ATTRIBUTE = "lora_layer_share"


# The layers LoRA can adapt.
AdaptableLinear = nn.Linear | Conv1D | QuantizedLinear


def layer_features(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a layer LoRA can adapt, else None."""
    if isinstance(module, (nn.Linear, Conv1D, QuantizedLinear)):
        return _features(module)
    return None


def _features(layer: AdaptableLinear) -> tuple[int, int]:
    if isinstance(layer, (nn.Linear, QuantizedLinear)):
        return layer.in_features, layer.out_features
    # GPT-2's Conv1D, a transposed linear: weight [in, out]
    return int(layer.weight.shape[0]), int(layer.weight.shape[1])


class BatchedLoRALinear(nn.Module):
    """A linear layer plus one LoRA delta per slot, applied per token group."""

    # Registered buffers (see __init__): every slot's A and scaled B.
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(self, base_layer: nn.Module, max_loras: int, max_lora_rank: int,
                 token_groups: LoRATokenGroups, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        assert isinstance(base_layer, (nn.Linear, Conv1D, QuantizedLinear)), \
            f"{type(base_layer).__name__} is not an adaptable linear layer"
        self.base_layer: AdaptableLinear = base_layer
        self.in_features, self.out_features = _features(base_layer)
        share = getattr(base_layer, SHARE_ATTRIBUTE, None)
        self.share: LayerShare | None = share if isinstance(share, LayerShare) else None
        self.token_groups = token_groups
        # ranks[s] == 0: slot s leaves this layer alone (empty, or its adapter skips it).
        self.ranks = [0] * max_loras
        shape_a = (max_loras, max_lora_rank, self.in_features)
        shape_b = (max_loras, self.out_features, max_lora_rank)
        self.register_buffer("lora_a", torch.zeros(shape_a, device=device, dtype=dtype), persistent=False)
        self.register_buffer("lora_b", torch.zeros(shape_b, device=device, dtype=dtype), persistent=False)

    @property
    def weight(self) -> torch.Tensor | None:
        """The base layer's weight (a QuantizedLinear's codes, or None for its W4 layout)."""
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @property
    def adapted_features(self) -> tuple[int, int]:
        """(in_features, out_features) of the layer an adapter adapts: the whole layer's,
        where this one is a share of it."""
        return (self.in_features, self.out_features) if self.share is None else \
            (self.share.in_features, self.share.out_features)

    def set_slot(self, slot: int, lora_a: torch.Tensor | None, scaled_lora_b: torch.Tensor | None) -> None:
        """Put one adapter's A [r, in] and scaled B [out, r] (the whole layer's, see
        ``adapted_features``) in ``slot``; None clears it."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if lora_a is None or scaled_lora_b is None:
            self.ranks[slot] = 0
            return
        if self.share is not None:  # this layer's part of the whole layer's adapter
            if self.share.columns is not None:
                lora_a = lora_a[:, _on(self.share.columns, lora_a.device)]
            if self.share.rows is not None:
                scaled_lora_b = scaled_lora_b[_on(self.share.rows, scaled_lora_b.device)]
        rank = lora_a.shape[0]
        assert lora_a.shape == (rank, self.in_features) and scaled_lora_b.shape == (self.out_features, rank)
        self.lora_a[slot, :rank].copy_(lora_a)
        self.lora_b[slot, :, :rank].copy_(scaled_lora_b)
        self.ranks[slot] = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features], flattened to the packed tokens [T, in_features]
        out = self.base_layer(x)
        groups = [(slot, rows) for slot, rows in self.token_groups.groups if self.ranks[slot]]
        if not groups:
            return out
        flat_x = x.reshape(-1, self.in_features)
        flat_out = out.view(-1, self.out_features)  # a view: the adds below land in ``out``
        if flat_x.shape[0] != self.token_groups.num_tokens:
            raise RuntimeError(
                f"LoRA token slots were set for {self.token_groups.num_tokens} tokens, but the forward "
                f"has {flat_x.shape[0]}; call LoRAManager.set_token_slots before each forward"
            )
        for slot, rows in groups:
            rank = self.ranks[slot]
            lora_a = self.lora_a[slot, :rank]      # [r, in]
            lora_b = self.lora_b[slot, :, :rank]   # [out, r]
            if rows is None:
                flat_out.add_((flat_x @ lora_a.T) @ lora_b.T)
            else:
                delta = (flat_x.index_select(0, rows) @ lora_a.T) @ lora_b.T  # [n_s, out]
                flat_out.index_add_(0, rows, delta)
        return out


def _on(index: torch.Tensor | slice, device: torch.device) -> torch.Tensor | slice:
    return index.to(device) if isinstance(index, torch.Tensor) else index


def _text_modules(model: nn.Module) -> set[int] | None:
    """ids of the modules of a vision-language model's text decoder, where LoRA applies
    (as vLLM's: its vision encoders and projector run outside the step's packed forward,
    without adapters, so an adapter with weights for them is refused as one for modules
    the model lacks); None for a text model: every layer may be adapted."""
    config = getattr(model, "config", None)
    get_decoder = getattr(model, "get_decoder", None)
    if config is None or get_decoder is None or config.get_text_config() is config:
        return None
    decoder = get_decoder()
    return {id(module) for module in decoder.modules()} if isinstance(decoder, nn.Module) else None


def wrap_adaptable_layers(model: nn.Module, max_loras: int, max_lora_rank: int, token_groups: LoRATokenGroups,
                          device: torch.device, dtype: torch.dtype) -> dict[str, BatchedLoRALinear]:
    """Replace every adaptable layer of ``model`` (not its output embeddings) by a
    BatchedLoRALinear, in place (through surgery.replace); return them by the module
    name an adapter gives them (a row share's inner linear: its parent's name)."""
    # A transformers model names its output embeddings; a bare nn.Module has none.
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    output_embeddings = get_output_embeddings() if get_output_embeddings is not None else None
    text_modules = _text_modules(model)
    targets = []
    for name, module in model.named_modules():
        if isinstance(module, BatchedLoRALinear):
            raise ValueError(f"model already has LoRA layers (at {name!r}); build one LoRAManager per model")
        if module is not output_embeddings and layer_features(module) is not None \
                and (text_modules is None or id(module) in text_modules):
            targets.append(name)
    wrapped = {}
    for name in targets:
        layer = BatchedLoRALinear(submodule(model, name), max_loras, max_lora_rank, token_groups, device, dtype)
        replace(model, name, layer)
        wrapped[name.rsplit(".", 1)[0] if layer.share is not None and layer.share.named_by_parent else name] = layer
    return wrapped
