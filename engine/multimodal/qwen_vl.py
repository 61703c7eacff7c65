"""The Qwen vision-language family's image facts (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): how
their processor's tensors split per image, each image's token grid for M-RoPE
(engine/multimodal/mrope.py), and Qwen3-VL's deepstack features.

Their processor flattens every image into patches: ``pixel_values`` [patches, C * T *
P * P] for all images of a call, one after another, and ``image_grid_thw`` [images, 3]
each image's (frames, patch rows, patch columns); the encoder merges ``merge`` x
``merge`` patches into one placeholder token.

Qwen3-VL's vision encoder also returns deepstack features: for each of a few early
decoder layers, one row per placeholder, added to that layer's output at the image's
positions. The encoder cache keeps them beside the main rows, in one tensor per image
[rows, hidden * (1 + layers)] (main rows first), so they are cached, evicted and split
by chunked prefill together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn


def split_patches(outputs: Mapping[str, Any], num_images: int) -> list[dict[str, torch.Tensor]]:
    """The processor's image tensors, one dict per image: its patches of
    ``pixel_values`` and its row of ``image_grid_thw`` [1, 3]."""
    grids = outputs["image_grid_thw"]
    pixel_values = outputs["pixel_values"]
    # grids: [images, 3]; pixel_values: [sum of t * h * w, C * T * P * P]
    assert grids.shape[0] == num_images, f"image_grid_thw {tuple(grids.shape)} for {num_images} images"
    sizes = grids.prod(-1).tolist()
    assert sum(sizes) == pixel_values.shape[0], f"{pixel_values.shape[0]} patches for grids {grids.tolist()}"
    return [{"pixel_values": patches, "image_grid_thw": grids[i : i + 1]}
            for i, patches in enumerate(pixel_values.split(sizes))]


def image_grid(pixel_inputs: Mapping[str, torch.Tensor], hf_config: transformers.PretrainedConfig) \
        -> tuple[int, int, int]:
    """One image's (frames, height, width) in placeholder tokens: its patch grid with
    rows and columns divided by the encoder's spatial merge."""
    merge = int(hf_config.vision_config.spatial_merge_size)
    frames, rows, columns = (int(value) for value in pixel_inputs["image_grid_thw"][0].tolist())
    return frames, rows // merge, columns // merge


def deepstack_features(model: nn.Module, pixel_inputs: dict[str, torch.Tensor],
                       rows_per_image: list[int]) -> list[torch.Tensor]:
    """Qwen3-VL's encoder output per image: [rows, hidden * (1 + deepstack layers)],
    the rows its placeholders take, then each deepstack layer's rows (see the module
    docstring)."""
    get_image_features = model.get_image_features
    assert callable(get_image_features), f"{type(model).__name__} has no get_image_features"
    output = get_image_features(**pixel_inputs, return_dict=True)
    main = list(output.pooler_output)
    deepstack = [list(layer) for layer in (output.deepstack_features or [])]
    assert len(main) == len(rows_per_image), f"{len(main)} feature blocks for {len(rows_per_image)} images"
    return [torch.cat([block, *(layer[i] for layer in deepstack)], dim=-1) for i, block in enumerate(main)]


def num_deepstack_layers(hf_config: transformers.PretrainedConfig) -> int:
    """How many early decoder layers take deepstack features (0 without them)."""
    return len(getattr(hf_config.vision_config, "deepstack_visual_indexes", None) or ())


# The model keyword argument a step's deepstack rows travel under, down to the text
# model (whose pre-hook hands them over as its own arguments).
DEEPSTACK_KEY = "shardline_deepstack"


@dataclass(frozen=True)
class DeepstackRows:
    """One step's deepstack inputs: ``mask`` [1, T] bool, the packed positions images
    fill, and per deepstack layer their rows [positions, hidden] in position order."""

    mask: torch.Tensor
    rows: list[torch.Tensor]


def split_deepstack(rows: torch.Tensor, targets: torch.Tensor, num_tokens: int, hidden_size: int) \
        -> tuple[torch.Tensor, DeepstackRows]:
    """An encoder output block for a step, ``rows`` [n, hidden * (1 + layers)] going to
    packed positions ``targets`` [n]: (the main rows [n, hidden], the step's
    DeepstackRows)."""
    order = torch.argsort(targets)
    mask = torch.zeros(1, num_tokens, dtype=torch.bool, device=rows.device)
    mask[0, targets] = True
    extra = rows[order, hidden_size:]
    return rows[:, :hidden_size], DeepstackRows(mask, list(extra.split(hidden_size, dim=-1)))


def install_deepstack_inputs(model: nn.Module) -> None:
    """Let a Qwen3-VL model take a step's deepstack rows as ``DEEPSTACK_KEY``: its
    conditional-generation forward passes unknown keywords on to its text model, whose
    pre-hook (``take_deepstack``, installed once) makes them the text model's
    ``visual_pos_masks`` and ``deepstack_visual_embeds`` (the model's own forward sets
    those only from pixels)."""
    language_model = model.get_submodule("model.language_model")
    if take_deepstack not in language_model._forward_pre_hooks.values():
        language_model.register_forward_pre_hook(take_deepstack, with_kwargs=True)


def take_deepstack(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The text model's pre-hook: ``DEEPSTACK_KEY`` becomes its deepstack arguments."""
    step = kwargs.pop(DEEPSTACK_KEY, None)
    if isinstance(step, DeepstackRows):
        kwargs["visual_pos_masks"] = step.mask
        kwargs["deepstack_visual_embeds"] = step.rows
    return args, kwargs
