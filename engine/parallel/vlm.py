"""A vision-language model over tensor-parallel ranks: the language model split, the
encoders whole.

The ranks split only the language model (the decoder and the LM head). The vision tower
and the projector stay whole on every rank and run on rank 0, where the encoder cache
calls them (engine/multimodal/encoder_cache.py); the other ranks run them only in their
own load check. The input embedding stays whole too: rank 0 looks up a step's ids and
scatters the image rows in alone, then sends the step's input embeddings [1, T, H] to
the ranks after its integer inputs (engine/parallel/ranks.py), so every rank's decoder
starts from the same rows. A Qwen3-VL step with images also carries its deepstack rows
(the image rows its early decoder layers add to their hidden states, which are whole on
every rank): their positions' mask travels with the integers, the rows stacked after the
embeddings, and every rank adds them whole.

Invariant: no module under an ``encoder_prefixes`` name is split, planned as a slice or
runs a collective, so rank 0 may run the encoders while the other ranks wait.
"""

from __future__ import annotations

import torch
from torch import nn

from ..multimodal.qwen_vl import DeepstackRows, install_deepstack_inputs
from .group import ShardingError


def encoder_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The names (each with a trailing dot) of a vision-language model's modules outside
    its language model: every child of the decoder's ancestors that is neither on the
    way to the decoder nor the LM head. Empty for a model without a vision config."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None:
        return ()
    names = {id(module): name for name, module in model.named_modules()}
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    decoder = get_decoder() if callable(get_decoder) else None
    head = get_head() if callable(get_head) else None
    if not isinstance(decoder, nn.Module) or id(decoder) not in names:
        raise ShardingError(f"{type(model).__name__}: its language model is not found (get_decoder), so the ranks "
                            "cannot tell it from the encoders; it is not split over ranks")
    decoder_name = names[id(decoder)]
    kept = {decoder_name, names.get(id(head), "")}
    path = decoder_name.split(".")
    ancestors = [".".join(path[:depth]) for depth in range(len(path))]
    prefixes = []
    for ancestor in ancestors:
        for child, _ in model.get_submodule(ancestor).named_children():
            full = f"{ancestor}.{child}" if ancestor else child
            if full not in kept and full not in ancestors:
                prefixes.append(f"{full}.")
    return tuple(prefixes)


def deepstack_layout(rows: DeepstackRows) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype of a step's deepstack rows stacked ([layers, rows, H]): what
    rank 0 broadcasts after the step's input embeddings (Qwen3-VL)."""
    first = rows.rows[0]
    return (len(rows.rows), *first.shape), first.dtype


def stacked_deepstack(rows: DeepstackRows) -> torch.Tensor:
    """A step's deepstack rows as one tensor [layers, rows, H] to broadcast."""
    return torch.stack(rows.rows).contiguous()


def received_deepstack(model: nn.Module, mask: torch.Tensor, stacked: torch.Tensor) -> DeepstackRows:
    """The deepstack rows rank 0 sent, for this rank's model (whose text model then takes
    them: the same pre-hook rank 0's encoder cache installs)."""
    install_deepstack_inputs(model)
    return DeepstackRows(mask.to(torch.bool), list(stacked.unbind(0)))
