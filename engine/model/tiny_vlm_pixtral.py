"""A tiny random-weight Mistral3-shaped checkpoint with its processor, built offline: a
Pixtral vision tower (each image at its own size, in patches with 2D rotary positions),
Mistral3's patch merger (``spatial_merge_size`` x ``spatial_merge_size`` patches into one
row) and projector, and a Mistral text model. Its processor is transformers'
PixtralProcessor over the PIL-backed PixtralImageProcessorPil (no torchvision): an image
becomes rows of ``[IMG]`` placeholders, each row ended by ``[IMG_BREAK]`` and the last
by ``[IMG_END]``. ``build_tiny_pixtral_llava``: Pixtral-12B's layout, a LLaVA model
with the Pixtral tower and no merger.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from ..multimodal.pixtral import PixtralImageProcessor
from .tiny import build_tokenizer
from .tiny_vlm import VLM_CHAT_TEMPLATE, _save

MARKERS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
# The LLaVA family's tiny template with Pixtral's image token.
CHAT_TEMPLATE = VLM_CHAT_TEMPLATE.replace("'<image>'", "'[IMG]'")


def build_tiny_mistral3(path: str | Path, seed: int = 0, patch_size: int = 4, spatial_merge_size: int = 2,
                        longest_edge: int = 48, num_text_layers: int = 3) -> Path:
    """A Mistral3-shaped checkpoint: images resized to fit ``longest_edge`` (keeping
    their aspect ratio, each side a multiple of ``patch_size * spatial_merge_size``), in
    ``patch_size`` patches merged ``spatial_merge_size`` x ``spatial_merge_size``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vision, text = _parts(path, patch_size, longest_edge, num_text_layers)
    image_token_id = tokenizer.convert_tokens_to_ids("[IMG]")
    config = transformers.Mistral3Config(vision_config=vision, text_config=text, image_token_index=image_token_id,
                                         spatial_merge_size=spatial_merge_size, vision_feature_layer=-1)
    torch.manual_seed(seed)
    model = transformers.Mistral3ForConditionalGeneration(config)
    return _save(path, model, _processor(tokenizer, patch_size, spatial_merge_size, longest_edge), seed)


def _parts(path: Path, patch_size: int, longest_edge: int, num_text_layers: int) -> tuple[Any, Any, Any]:
    """The tokenizer with Pixtral's markers, a Pixtral vision config and a Mistral text config."""
    tokenizer = build_tokenizer(path, vocab_size=512, extra_special_tokens=MARKERS)
    tokenizer.chat_template = CHAT_TEMPLATE
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=longest_edge, patch_size=patch_size)
    text = transformers.MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_text_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, bos_token_id=0,
        eos_token_id=1, pad_token_id=2)
    return tokenizer, vision, text


def build_tiny_pixtral_llava(path: str | Path, seed: int = 0, patch_size: int = 8, longest_edge: int = 48,
                             num_text_layers: int = 3) -> Path:
    """A LLaVA checkpoint with a Pixtral vision tower: one row per ``patch_size`` patch."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vision, text = _parts(path, patch_size, longest_edge, num_text_layers)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
                                      vision_feature_layer=-1, vision_feature_select_strategy="full")
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config)
    return _save(path, model, _processor(tokenizer, patch_size, 1, longest_edge), seed)


def _processor(tokenizer: Any, patch_size: int, spatial_merge_size: int, longest_edge: int) -> PixtralImageProcessor:
    image_processor = transformers.PixtralImageProcessorPil(size={"longest_edge": longest_edge},
                                                            patch_size={"height": patch_size, "width": patch_size})
    return PixtralImageProcessor(image_processor, tokenizer, patch_size=patch_size,
                                 spatial_merge_size=spatial_merge_size, chat_template=CHAT_TEMPLATE)
