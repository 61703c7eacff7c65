"""A tiny random-weight Gemma 3 vision-language checkpoint with its processor, built
offline like the LLaVA family's (engine/model/tiny_vlm.py): a SigLIP vision tower,
Gemma 3's pooled, normed projector and a Gemma 3 text model with sliding-window and
full-attention layers. Its image rows attend to each other both ways, which is what
the engine's paged attention must reproduce.

The processor is transformers' Gemma3Processor over its PIL-backed image processor
(no torchvision); the prompt marks an image with ``<start_of_image>``, which the
processor expands into ``<start_of_image>``, one ``<image_soft_token>`` per image row
and ``<end_of_image>``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from .tiny import build_tokenizer
from .tiny_vlm import VLM_CHAT_TEMPLATE, _scale_weights

BOI_TOKEN, EOI_TOKEN, SOFT_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# Token embeddings small beside the layers' normed outputs (Gemma scales them by
# sqrt(hidden)), so the output follows the context, not the last token alone.
EMBEDDING_STD, PROJECTOR_STD = 0.05, 0.2
GEMMA3_CHAT_TEMPLATE = VLM_CHAT_TEMPLATE.replace("'<image>'", f"'{BOI_TOKEN}'")


def build_tiny_gemma3(path: str | Path, seed: int = 0, image_size: int = 32, patch_size: int = 4,
                      mm_tokens_per_image: int = 16, sliding_window: int = 8, num_text_layers: int = 3) -> Path:
    """A Gemma 3-shaped checkpoint: (image_size / patch_size)^2 SigLIP patches average-
    pooled to ``mm_tokens_per_image`` rows per image; text layers alternating
    sliding-window (``sliding_window`` tokens, shorter than an image's rows) and full
    attention."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, vocab_size=512, extra_special_tokens=[BOI_TOKEN, EOI_TOKEN, SOFT_TOKEN])
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
        str(path), extra_special_tokens={"boi_token": BOI_TOKEN, "eoi_token": EOI_TOKEN, "image_token": SOFT_TOKEN})
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (BOI_TOKEN, EOI_TOKEN, SOFT_TOKEN)}
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=image_size,
        patch_size=patch_size, vision_use_head=False)
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_text_layers)]
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_text_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=sliding_window, layer_types=layer_types, max_position_embeddings=2048,
        bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens_per_image,
        boi_token_index=ids[BOI_TOKEN], eoi_token_index=ids[EOI_TOKEN], image_token_index=ids[SOFT_TOKEN])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    processor = transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                             chat_template=GEMMA3_CHAT_TEMPLATE,
                                             image_seq_length=mm_tokens_per_image)
    _scale_weights(model, 0.2)
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight.normal_(0.0, EMBEDDING_STD)  # the lm head too (tied)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, PROJECTOR_STD)
    model.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(str(path), safe_serialization=True)
    processor.save_pretrained(str(path))
    return path
