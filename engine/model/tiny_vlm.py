"""Tiny random-weight vision-language checkpoints with their processors, built offline
(config, safetensors weights, tokenizer, image processor, chat template), for the
tests and benchmarks: they load through the same path as a hub model.

The image processors are transformers' PIL-backed ones, which need no torchvision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from .tiny import build_tokenizer

IMAGE_TOKEN = "<image>"
# A chat template in transformers' multimodal message format: {"type": "image"} parts
# become the image token, text parts their text.
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _scale_weights(model: torch.nn.Module, std: float) -> None:
    """Weights well above transformers' 0.02 init, so the output depends on the input."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, std)


TinyParts = tuple[transformers.PreTrainedTokenizerFast, int, transformers.CLIPVisionConfig, transformers.LlamaConfig]


def _tiny_parts(path: Path, hidden_size: int, num_text_layers: int, image_size: int, patch_size: int,
                num_vision_layers: int = 2, **text_overrides: Any) -> TinyParts:
    """The tokenizer (with ``<image>`` and the chat template), the image token id, a CLIP
    vision config and a Llama text config shared by the LLaVA-family builders."""
    tokenizer = build_tokenizer(path, vocab_size=512, extra_special_tokens=[IMAGE_TOKEN])
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert isinstance(image_token_id, int), image_token_id
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=num_vision_layers, num_attention_heads=2,
        image_size=image_size, patch_size=patch_size, projection_dim=32)
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_text_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, pad_token_id=2, **text_overrides)
    return tokenizer, image_token_id, vision, text


def _save(path: Path, model: transformers.PreTrainedModel, processor: Any, seed: int) -> Path:
    _scale_weights(model, 0.2)
    model.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(str(path), safe_serialization=True)
    processor.save_pretrained(str(path))
    return path


def build_tiny_llava(path: str | Path, seed: int = 0, image_size: int = 32, patch_size: int = 8,
                     hidden_size: int = 64, num_text_layers: int = 3, model_type: str = "llava",
                     num_vision_layers: int = 2, **text_overrides: Any) -> Path:
    """A LLaVA-shaped checkpoint: a CLIP vision tower ((image_size / patch_size)^2
    patches, the CLS row dropped), the two-layer projector and a Llama text model,
    with a LlavaProcessor (CLIP image processor, byte-level tokenizer with ``<image>``);
    ``model_type`` "vipllava": VipLLaVA's multi-layer features and normed projector."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, image_token_id, vision, text = _tiny_parts(path, hidden_size, num_text_layers, image_size,
                                                          patch_size, num_vision_layers, **text_overrides)
    num_patches = (image_size // patch_size) ** 2
    torch.manual_seed(seed)
    if model_type == "vipllava":  # features of two vision layers side by side, a normed projector
        model = transformers.VipLlavaForConditionalGeneration(transformers.VipLlavaConfig(
            vision_config=vision, text_config=text, image_token_index=image_token_id, vision_feature_layer=(-2, -1),
            image_seq_length=num_patches))
    else:
        model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
            vision_config=vision, text_config=text, image_token_index=image_token_id, vision_feature_layer=-1,
            vision_feature_select_strategy="default", image_seq_length=num_patches))
    image_processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
        vision_feature_select_strategy="default", image_token=IMAGE_TOKEN, num_additional_image_tokens=1,
        chat_template=VLM_CHAT_TEMPLATE)
    return _save(path, model, processor, seed)


def build_tiny_llava_next(path: str | Path, seed: int = 0, image_size: int = 32, patch_size: int = 8,
                          hidden_size: int = 64, num_text_layers: int = 3) -> Path:
    """A LLaVA-NeXT-shaped checkpoint: as build_tiny_llava, with "anyres" tiling (a base
    view plus tiles on a grid picked from the image's aspect ratio, each image its own
    number of placeholder tokens, rows ended by the learned newline embedding)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, image_token_id, vision, text = _tiny_parts(path, hidden_size, num_text_layers, image_size,
                                                          patch_size)
    pinpoints = [[image_size, image_size], [image_size, 2 * image_size], [2 * image_size, image_size]]
    config = transformers.LlavaNextConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id, vision_feature_layer=-1,
        vision_feature_select_strategy="default", image_grid_pinpoints=pinpoints,
        image_seq_length=(image_size // patch_size) ** 2)
    torch.manual_seed(seed)
    model = transformers.LlavaNextForConditionalGeneration(config)
    with torch.no_grad():
        model.model.image_newline.normal_(0.0, 1.0)
    image_processor = transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        image_grid_pinpoints=pinpoints)
    processor = transformers.LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
        vision_feature_select_strategy="default", image_token=IMAGE_TOKEN, num_additional_image_tokens=1,
        chat_template=VLM_CHAT_TEMPLATE)
    return _save(path, model, processor, seed)
