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

import torch
import transformers

from ..multimodal.image_only import build_image_only
from .tiny import build_tokenizer
from .tiny_vlm import VLM_CHAT_TEMPLATE, _save
from .tiny_vlm_idefics3 import MARKERS


def build_tiny_smolvlm(path: str | Path, seed: int = 0, tile_size: int = 32, patch_size: int = 8,
                       scale_factor: int = 2, longest_edge: int = 64, num_text_layers: int = 3) -> Path:
    """A SmolVLM-shaped checkpoint: tiles of ``tile_size`` pixels in ``patch_size``
    patches, shuffled ``scale_factor`` x ``scale_factor`` into (tile_size / patch_size /
    scale_factor)^2 rows per tile (not the processor's default ``image_seq_len``, so a
    processor that lost the saved value miscounts); images resized to ``longest_edge``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path, vocab_size=512, extra_special_tokens=MARKERS)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    assert isinstance(image_token_id, int), image_token_id
    vision = transformers.SmolVLMVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=tile_size, patch_size=patch_size)
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_text_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
        pad_token_id=2)
    config = transformers.SmolVLMConfig(vision_config=vision, text_config=text, image_token_id=image_token_id,
                                        scale_factor=scale_factor)
    torch.manual_seed(seed)
    model = transformers.SmolVLMForConditionalGeneration(config)
    image_processor = transformers.SmolVLMImageProcessorPil(
        size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile_size}, do_image_splitting=True)
    rows_per_tile = (tile_size // patch_size // scale_factor) ** 2
    processor = build_image_only(transformers.SmolVLMProcessor, image_processor, tokenizer, VLM_CHAT_TEMPLATE,
                                 image_seq_len=rows_per_tile)
    return _save(path, model, processor, seed)
