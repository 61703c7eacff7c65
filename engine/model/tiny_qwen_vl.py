"""Tiny random-weight Qwen vision-language checkpoints (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)
with their processors, built offline for the tests and benchmarks: they load through
the same path as a hub checkpoint.

The processor is the model type's own class built without a video processor
(engine/multimodal/image_only.py: transformers' video processors need torchvision)
over the PIL image processor (Qwen2VLImageProcessorPil) and a byte-level tokenizer
with Qwen's vision tokens. Patches of 4 pixels merged 2 x 2, and at most 32 x 32
pixels an image: a few placeholder tokens per image, on grids of several shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from ..multimodal.image_only import build_image_only
from .tiny import build_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# The processor class each type's checkpoint names.
PROCESSOR_CLASSES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                     **dict.fromkeys(("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"), "Qwen3VLProcessor")}
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# Qwen's multimodal chat format: an image part is the vision start token, one image pad
# (which the processor expands) and the vision end token.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PATCH_SIZE, MERGE_SIZE, MAX_PIXELS = 4, 2, 32 * 32


def _configs(model_type: str, vocab_size: int, hidden_size: int, num_text_layers: int) \
        -> tuple[dict[str, Any], dict[str, Any]]:
    """(text config, vision config) keyword arguments of a tiny ``model_type``."""
    head_dim = hidden_size // 4
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]}
    text: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_text_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, pad_token_id=2, rope_parameters=rope)
    vision: dict[str, Any] = dict(depth=2, num_heads=2, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
                                  temporal_patch_size=2)
    if model_type == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=hidden_size)
    elif model_type == "qwen2_5_vl":  # window attention in block 0, full attention in block 1
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=hidden_size,
                      window_size=2 * PATCH_SIZE * MERGE_SIZE, fullatt_block_indexes=[1])
    else:  # Qwen3-VL and Qwen3.5: a learned position table, interleaved M-RoPE sections
        text.update(head_dim=head_dim)
        rope["mrope_interleaved"] = True
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=hidden_size, num_position_embeddings=16)
    if model_type.startswith("qwen3_vl"):  # deepstack features from vision block 0
        vision.update(deepstack_visual_indexes=[0])
    if model_type.startswith("qwen3_5"):  # gated delta-net layers around a full-attention one, half the dims rotated
        text.update(head_dim=2 * head_dim, layer_types=["linear_attention", "full_attention", "linear_attention"],
                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4)
        rope["partial_rotary_factor"] = 0.5
    if model_type.endswith("_moe"):
        text.update(_MOE, **({"shared_expert_intermediate_size": 32} if model_type == "qwen3_5_moe" else {}))
    return text, vision


def build_tiny_qwen_vl(path: str | Path, model_type: str = "qwen2_vl", seed: int = 0, hidden_size: int = 64,
                       num_text_layers: int = 3) -> Path:
    """A ``model_type`` (one of QWEN_VL_TYPES) checkpoint with its processor in ``path``
    (see the module docstring); weights well above transformers' 0.02 init, so its tokens
    depend on the image."""
    if model_type not in QWEN_VL_TYPES:
        raise ValueError(f"model_type must be one of {', '.join(QWEN_VL_TYPES)}, got {model_type!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path, vocab_size=512, extra_special_tokens=[VISION_START, VISION_END, IMAGE_PAD,
                                                                            VIDEO_PAD])
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}
    text, vision = _configs(model_type, len(tokenizer), hidden_size, num_text_layers)
    config_class: Any = type(transformers.AutoConfig.for_model(model_type))
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD],
                          video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
                          vision_end_token_id=ids[VISION_END])
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.2)
    model.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(str(path), safe_serialization=True)
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=(PATCH_SIZE * MERGE_SIZE) ** 2, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE, temporal_patch_size=2)
    processor_class = getattr(transformers, PROCESSOR_CLASSES[model_type])
    build_image_only(processor_class, image_processor, tokenizer, QWEN_VL_CHAT_TEMPLATE).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path
