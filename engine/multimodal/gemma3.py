"""Gemma 3's pan-and-scan: with ``do_pan_and_scan`` (an ``mm_processor_kwargs`` setting)
its processor adds crops of a wide or tall image beside the whole image, each crop one
more view of ``mm_tokens_per_image`` rows between its own markers, with text between
the views. The engine keeps one ImageInput per prompt image holding all its views (its
positions are every view's rows), so the encoder cache and the prefix cache key them
by the image: ``count_views`` says how many views each image gets (the image processor's
own crop rule, run on the image's size), ``split_views`` gives each image its rows of
``pixel_values`` ([views of every image, C, H, W]).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from PIL import Image

PAN_AND_SCAN_KWARGS = frozenset({"do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                                 "pan_and_scan_min_ratio_to_activate"})


def _setting(processor: Any, kwargs: Mapping[str, Any], name: str) -> Any:
    """A pan-and-scan setting as the processor resolves it: the call's, else the image
    processor's saved one, else the processor's default."""
    if name in kwargs:
        return kwargs[name]
    saved = getattr(processor.image_processor, name, None)
    return saved if saved is not None else getattr(processor, "images_kwargs", {}).get(name)


def count_views(processor: Any, images: list[Image.Image], kwargs: Mapping[str, Any]) -> list[int]:
    """How many views (the image and its crops) the processor makes of each image."""
    if not _setting(processor, kwargs, "do_pan_and_scan"):
        return [1] * len(images)
    settings = {name: _setting(processor, kwargs, name) for name in PAN_AND_SCAN_KWARGS - {"do_pan_and_scan"}}
    views = []
    for image in images:
        # The crop rule reads only the image's size: a zero tensor of its shape that holds no pixels.
        shape_only = torch.zeros(1, dtype=torch.uint8).expand(3, image.height, image.width)
        views.append(1 + len(processor.image_processor.pan_and_scan(image=shape_only, **settings)))
    return views


def split_views(outputs: Mapping[str, Any], rows_per_image: list[int]) -> list[dict[str, torch.Tensor]]:
    """``pixel_values`` [views, C, H, W] of one prompt, one dict per image by its
    placeholder rows (every view fills as many)."""
    pixel_values = outputs["pixel_values"]
    total = sum(rows_per_image)
    assert total % pixel_values.shape[0] == 0, f"{total} placeholder rows for {pixel_values.shape[0]} views"
    rows_per_view = total // pixel_values.shape[0]
    assert all(rows % rows_per_view == 0 for rows in rows_per_image), (rows_per_image, rows_per_view)
    parts = pixel_values.split([rows // rows_per_view for rows in rows_per_image])
    return [{"pixel_values": part} for part in parts]
