"""A tiny random-weight Idefics3-shaped checkpoint with its processor, built offline like
the LLaVA family's (engine/model/tiny_vlm.py): a SigLIP-like vision tower, the
pixel-shuffle connector and a Llama text model. Its processor splits an image into tiles
on a grid picked from the image's size plus a downscaled global view, each tile one run
of ``<image>`` rows after a ``<fake_token_around_image>`` and a ``<row_i_col_j>`` (or
``<global-img>``) marker; it is transformers' Idefics3Processor over its PIL-backed
image processor (no torchvision).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from .tiny import build_tokenizer
from .tiny_vlm import VLM_CHAT_TEMPLATE, _save

MARKERS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
           *(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7))]


def build_tiny_idefics3(path: str | Path, seed: int = 0, tile_size: int = 32, patch_size: int = 8,
                        scale_factor: int = 2, longest_edge: int = 64, num_text_layers: int = 3) -> Path:
    """An Idefics3-shaped checkpoint: tiles of ``tile_size`` pixels in ``patch_size``
    patches, shuffled ``scale_factor`` x ``scale_factor`` into (tile_size / patch_size /
    scale_factor)^2 rows per tile; images resized to ``longest_edge`` before tiling."""
    def processor(image_processor, tokenizer, rows_per_tile: int):
        return transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                              image_seq_len=rows_per_tile, chat_template=VLM_CHAT_TEMPLATE)

    classes = TiledClasses(transformers.Idefics3VisionConfig, transformers.Idefics3Config,
                           transformers.Idefics3ForConditionalGeneration, transformers.Idefics3ImageProcessorPil,
                           processor)
    return build_tiled_vlm(path, classes, seed, tile_size, patch_size, scale_factor, longest_edge, num_text_layers)


@dataclass(frozen=True)
class TiledClasses:
    """The transformers classes of one tiled-image family (Idefics3, SmolVLM) and how
    its processor is built from (image processor, tokenizer, rows per tile)."""

    vision_config: type
    config: type
    model: type
    image_processor: type
    processor: Callable[[Any, Any, int], Any]


def build_tiled_vlm(path: str | Path, classes: TiledClasses, seed: int, tile_size: int, patch_size: int,
                    scale_factor: int, longest_edge: int, num_text_layers: int) -> Path:
    """A tiled-image checkpoint of ``classes``' family with a Llama text model (the
    shapes ``build_tiny_idefics3`` describes)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path, vocab_size=512, extra_special_tokens=MARKERS)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    assert isinstance(image_token_id, int), image_token_id
    vision = classes.vision_config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, image_size=tile_size, patch_size=patch_size)
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_text_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
        pad_token_id=2)
    config = classes.config(vision_config=vision, text_config=text, image_token_id=image_token_id,
                            scale_factor=scale_factor)
    torch.manual_seed(seed)
    model = classes.model(config)
    image_processor = classes.image_processor(
        size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile_size}, do_image_splitting=True)
    rows_per_tile = (tile_size // patch_size // scale_factor) ** 2
    return _save(path, model, classes.processor(image_processor, tokenizer, rows_per_tile), seed)
