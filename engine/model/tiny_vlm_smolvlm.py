"""A tiny random-weight SmolVLM-shaped checkpoint with its processor, built offline: the
Idefics3 layout (engine/model/tiny_vlm_idefics3.py: tiles on a grid picked from the
image's size plus a global view, each tile one run of ``<image>`` rows after its
markers, the pixel-shuffle connector) with SmolVLM's classes. Its processor is
transformers' SmolVLMProcessor over its PIL-backed image processor, built without its
video processor (which imports torchvision), as the engine builds it
(engine/multimodal/image_only.py); ``image_seq_len`` is saved in processor_config.json.
"""

from __future__ import annotations

from pathlib import Path

import transformers

from ..multimodal.image_only import build_image_only
from .tiny_vlm import VLM_CHAT_TEMPLATE
from .tiny_vlm_idefics3 import TiledClasses, build_tiled_vlm


def build_tiny_smolvlm(path: str | Path, seed: int = 0, tile_size: int = 32, patch_size: int = 8,
                       scale_factor: int = 2, longest_edge: int = 64, num_text_layers: int = 3) -> Path:
    """A SmolVLM-shaped checkpoint: tiles of ``tile_size`` pixels in ``patch_size``
    patches, shuffled ``scale_factor`` x ``scale_factor`` into (tile_size / patch_size /
    scale_factor)^2 rows per tile (not the processor's default ``image_seq_len``, so a
    processor that lost the saved value miscounts); images resized to ``longest_edge``."""
    def processor(image_processor, tokenizer, rows_per_tile: int):
        return build_image_only(transformers.SmolVLMProcessor, image_processor, tokenizer, VLM_CHAT_TEMPLATE,
                                image_seq_len=rows_per_tile)

    classes = TiledClasses(transformers.SmolVLMVisionConfig, transformers.SmolVLMConfig,
                           transformers.SmolVLMForConditionalGeneration, transformers.SmolVLMImageProcessorPil,
                           processor)
    return build_tiled_vlm(path, classes, seed, tile_size, patch_size, scale_factor, longest_edge, num_text_layers)
