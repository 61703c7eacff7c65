"""Idefics3's images: its processor cuts each image into tiles plus a global view and
returns one prompt's tiles of every image side by side (``pixel_values`` [1, tiles,
C, H, W], ``pixel_attention_mask`` [1, tiles, H, W]); each tile fills one run of the
same number of placeholder rows. ``split_tiles`` gives each image its own tiles, so the
encoder cache keeps them by image; the model's ``get_image_features`` takes them as
[images, tiles, C, H, W] (a batch of images with as many tiles each). SmolVLM's
processor writes the same layout but does not count each image's rows for a prompt
(``_get_num_multimodal_tokens``): ``rows_by_global_view`` reads them off the prompt, as
every image's expansion ends with its global view's run of rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

_TILE_KEYS = ("pixel_values", "pixel_attention_mask")


def split_tiles(outputs: Mapping[str, Any], rows_per_image: list[int]) -> list[dict[str, torch.Tensor]]:
    """The processor's tile tensors of one prompt, one dict per image, by each image's
    placeholder rows (every tile fills as many)."""
    pixel_values = outputs["pixel_values"]
    assert pixel_values.shape[0] == 1, f"pixel_values {tuple(pixel_values.shape)} for one prompt"
    num_tiles = pixel_values.shape[1]
    total = sum(rows_per_image)
    assert total % num_tiles == 0, f"{total} placeholder rows for {num_tiles} tiles"
    rows_per_tile = total // num_tiles
    assert all(rows % rows_per_tile == 0 for rows in rows_per_image), (rows_per_image, rows_per_tile)
    tiles = [rows // rows_per_tile for rows in rows_per_image]
    tensors = {key: outputs[key] for key in _TILE_KEYS if isinstance(outputs.get(key), torch.Tensor)}
    parts = {key: value.split(tiles, dim=1) for key, value in tensors.items()}
    return [{key: parts[key][index] for key in parts} for index in range(len(rows_per_image))]


def rows_by_global_view(processor: Any, token_ids: list[int], image_token_id: int) -> list[int]:
    """Each image's placeholder rows in a processed prompt: the rows up to and including
    the run after each ``<global-img>`` marker (an image's last tile)."""
    global_id = processor.tokenizer.convert_tokens_to_ids(processor.global_image_token)
    counts: list[int] = []
    count, in_global = 0, False
    for token_id in token_ids:
        if token_id == image_token_id:
            count += 1
            continue
        if in_global:
            counts.append(count)
            count, in_global = 0, False
        in_global = token_id == global_id
    if in_global:
        counts.append(count)
    return counts
