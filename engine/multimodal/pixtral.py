"""Pixtral's and Mistral3's images without torchvision. transformers' PixtralProcessor
imports its torchvision image processor, so it cannot be built on a host without
torchvision; ``PixtralImageProcessor`` here does the same work with the PIL-backed
PixtralImageProcessorPil and the tokenizer: each image, resized to fit the longest edge
in whole merged patches (``patch_size * spatial_merge_size`` pixels), becomes rows of
``[IMG]`` placeholders, one per merged patch, each row ended by ``[IMG_BREAK]`` and the
last by ``[IMG_END]``. Its settings are read from the directory's processor_config.json
(as transformers' processor reads them).

The vision tower takes each image at its own size (its patches attend within the
image), so ``split_sized`` crops every image's pixels to its size: images of the same
size then share one encoder batch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image
from transformers.utils.hub import cached_file

PROCESSOR_CONFIG = "processor_config.json"


class PixtralImageProcessor:
    """PixtralProcessor's image expansion and pixels (see the module docstring)."""

    def __init__(self, image_processor: Any, tokenizer: Any, patch_size: int = 16, spatial_merge_size: int = 1,
                 image_token: str = "[IMG]", image_break_token: str = "[IMG_BREAK]",
                 image_end_token: str = "[IMG_END]", chat_template: str | None = None) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.patch_size = patch_size
        self.spatial_merge_size = spatial_merge_size
        self.image_token = image_token
        self.image_break_token = image_break_token
        self.image_end_token = image_end_token
        self.chat_template = chat_template

    @classmethod
    def from_pretrained(cls, model: str, **kwargs: Any) -> PixtralImageProcessor:
        """The processor of a model directory or hub name (its image processor, tokenizer
        and processor_config.json settings)."""
        settings = processor_settings(model, **kwargs)
        names = ("patch_size", "spatial_merge_size", "image_token", "image_break_token", "image_end_token")
        image_processor = transformers.PixtralImageProcessorPil.from_pretrained(model, **kwargs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model, **kwargs)
        return cls(image_processor, tokenizer, chat_template=getattr(tokenizer, "chat_template", None),
                   **{name: settings[name] for name in names if name in settings})

    def save_pretrained(self, path: str | Path) -> None:
        """The image processor, tokenizer and processor_config.json, as PixtralProcessor saves them."""
        self.image_processor.save_pretrained(str(path))
        self.tokenizer.save_pretrained(str(path))
        settings = {"processor_class": "PixtralProcessor", "patch_size": self.patch_size,
                    "spatial_merge_size": self.spatial_merge_size, "image_token": self.image_token,
                    "image_break_token": self.image_break_token, "image_end_token": self.image_end_token}
        (Path(path) / PROCESSOR_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")

    def expansion(self, height: int, width: int) -> str:
        """The placeholder text of one image resized to ``height`` x ``width`` pixels."""
        merged = self.patch_size * self.spatial_merge_size
        assert height % merged == 0 and width % merged == 0, (height, width, merged)
        rows = [self.image_token * (width // merged) + self.image_break_token] * (height // merged)
        return "".join(rows)[: -len(self.image_break_token)] + self.image_end_token

    def __call__(self, text: str | list[str], images: list[Image.Image] | None = None, return_tensors: str = "pt",
                 **kwargs: Any) -> transformers.BatchFeature:
        """Token ids with each ``[IMG]`` of ``text`` expanded for its image, the pixels
        ([images, C, H, W], padded to the largest) and each image's resized size."""
        texts = [text] if isinstance(text, str) else list(text)
        assert return_tensors == "pt", return_tensors
        found = sum(item.count(self.image_token) for item in texts)
        images = list(images or ())
        if found != len(images):
            raise ValueError(f"{found} {self.image_token} token(s) in the text for {len(images)} image(s)")
        data: dict[str, Any] = {}
        if images:
            merged = self.patch_size * self.spatial_merge_size
            pixels = self.image_processor(images, patch_size={"height": merged, "width": merged}, return_tensors="pt")
            data.update(pixels)
            sizes = iter(pixels["image_sizes"].tolist())
            texts = ["".join(part if i == 0 else self.expansion(*next(sizes)) + part
                             for i, part in enumerate(item.split(self.image_token))) for item in texts]
        data.update(self.tokenizer(texts, return_tensors="pt", **kwargs))
        return transformers.BatchFeature(data)


def processor_settings(model: str, **kwargs: Any) -> dict[str, Any]:
    """The model's processor_config.json ({} where it has none), local or from the hub."""
    kwargs = {key: value for key, value in kwargs.items() if key in ("revision", "cache_dir", "token")}
    path = cached_file(model, PROCESSOR_CONFIG, _raise_exceptions_for_missing_entries=False, **kwargs)
    return json.loads(Path(path).read_text()) if path is not None else {}


def split_sized(outputs: Mapping[str, Any], num_images: int) -> list[dict[str, torch.Tensor]]:
    """One dict per image: its pixels cropped to its size (``image_sizes``) and its size."""
    sizes = outputs["image_sizes"]
    assert sizes.shape[0] == num_images, f"image_sizes {tuple(sizes.shape)} for {num_images} images"
    return [{"pixel_values": outputs["pixel_values"][i : i + 1, :, :height, :width], "image_sizes": sizes[i : i + 1]}
            for i, (height, width) in enumerate(sizes.tolist())]


def rows_by_end_marker(processor: Any, token_ids: list[int], image_token_id: int) -> list[int]:
    """Each image's placeholder rows in a processed prompt: the rows before each ``[IMG_END]``."""
    end_id = processor.tokenizer.convert_tokens_to_ids(processor.image_end_token)
    counts: list[int] = []
    count = 0
    for token_id in token_ids:
        if token_id == image_token_id:
            count += 1
        elif token_id == end_id:
            counts.append(count)
            count = 0
    return counts
