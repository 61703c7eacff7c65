"""Per-architecture facts the engine needs to run a vision-language model: the config
field naming its image placeholder token, how its vision encoder turns one batch of
processed images into one block of embedding rows per image, and how many images a
prompt may hold. A model type absent here takes no images on shardline (its text
part may still run as a causal LM, and its image prompts are refused).

The encoder output of an image has exactly one row per placeholder position the
processor wrote for it (checked when it is scattered).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

from .gemma3 import PAN_AND_SCAN_KWARGS, count_views, split_views
from .idefics import rows_by_global_view, split_tiles
from .pixtral import rows_by_end_marker, split_sized
from .qwen_vl import deepstack_features, image_grid, split_patches

# One batch of processed images (the processor's tensors, concatenated on dim 0) and
# each image's placeholder count -> one [rows, hidden] tensor per image, in order.
Encoder = Callable[[nn.Module, dict[str, torch.Tensor], list[int]], list[torch.Tensor]]
# The processor's outputs for a call with n images -> one dict of tensors per image.
Splitter = Callable[[Mapping[str, Any], int], list[dict[str, torch.Tensor]]]
# The processor's outputs for a call and each image's placeholder rows -> one dict per image.
RowSplitter = Callable[[Mapping[str, Any], list[int]], list[dict[str, torch.Tensor]]]
# The processor, a processed prompt's token ids and the placeholder id -> each image's rows.
RowCounter = Callable[[Any, list[int], int], list[int]]
# One image's tensors and the model's config -> its (frames, height, width) in tokens.
GridOf = Callable[[Mapping[str, torch.Tensor], transformers.PretrainedConfig], tuple[int, int, int]]
# The processor, a prompt's images and the processor settings -> each image's views (the
# image and the crops its processor adds), which fill as many rows each.
ViewCounter = Callable[[Any, list[Any], Mapping[str, Any]], list[int]]


def image_features(model: nn.Module, pixel_inputs: dict[str, torch.Tensor],
                   rows_per_image: list[int]) -> list[torch.Tensor]:
    """The model's own ``get_image_features`` (vision tower, feature selection and
    projector), as one tensor per image: its output is a list of them, or image-major
    rows in any other layout (one tensor of every image's rows, [images, rows, hidden]),
    split by ``rows_per_image``."""
    get_image_features = model.get_image_features
    assert callable(get_image_features), f"{type(model).__name__} has no get_image_features"
    output = get_image_features(**pixel_inputs, return_dict=True)
    features = output.pooler_output
    blocks = [features] if isinstance(features, torch.Tensor) else list(features)
    if len(blocks) == len(rows_per_image) and all(b.dim() == 2 for b in blocks):
        return blocks
    # Image-major rows in any other layout (one tensor, or [images, rows, hidden]).
    rows = torch.cat([block.reshape(-1, block.shape[-1]) for block in blocks])
    assert rows.shape[0] == sum(rows_per_image), f"{rows.shape[0]} feature rows for {sum(rows_per_image)} placeholders"
    return list(rows.split(rows_per_image))


@dataclass(frozen=True)
class VisionSpec:
    """How the engine runs one vision-language architecture (see the module docstring).
    ``max_images`` None: no limit of the model's own."""

    model_type: str
    encode: Encoder = image_features
    max_images: int | None = None
    # Whether an image's rows attend to each other both ways (Gemma 3's mask: causal, plus
    # full attention within one image): its placeholders are then computed in one step
    # (engine/core/scheduler.py) and their queries see the image's later keys.
    bidirectional: bool = False
    # For processors whose tensors do not hold one leading row per image (Idefics3's
    # tiles of every image side by side): one dict per image, by its placeholder rows.
    split_by_rows: RowSplitter | None = None
    # For processors that cannot count each image's rows for a prompt (SmolVLM's): reads
    # them off the processed prompt.
    count_rows: RowCounter | None = None
    # None: each processor tensor has one leading row per image.
    split: Splitter | None = None
    # Set for models whose rotary positions follow each image's grid (M-RoPE,
    # engine/multimodal/mrope.py): the runner then passes [3, 1, T] position ids.
    grid: GridOf | None = None
    # Early decoder layers that add a part of the encoder output at the image's
    # positions (Qwen3-VL's deepstack, engine/multimodal/qwen_vl.py).
    deepstack: bool = False
    # The ``mm_processor_kwargs`` keys the engine passes to this model's processor (the
    # rest are refused): settings that change how many rows an image fills need ``views``.
    processor_kwargs: frozenset[str] = frozenset()
    views: ViewCounter | None = None

    def image_token_id(self, hf_config: transformers.PretrainedConfig) -> int:
        """The placeholder token id the processor writes for every image row."""
        for name in ("image_token_id", "image_token_index"):
            value = getattr(hf_config, name, None)
            if isinstance(value, int):
                return value
        raise ValueError(f"{self.model_type} config names no image token (image_token_id / image_token_index)")


VISION_SPECS: dict[str, VisionSpec] = {spec.model_type: spec for spec in (
    VisionSpec("llava"),
    VisionSpec("llava_next"),
    VisionSpec("vipllava"),
    VisionSpec("gemma3", bidirectional=True, split_by_rows=split_views, processor_kwargs=PAN_AND_SCAN_KWARGS,
               views=count_views),
    VisionSpec("idefics3", split_by_rows=split_tiles),
    VisionSpec("smolvlm", split_by_rows=split_tiles, count_rows=rows_by_global_view),
    VisionSpec("mistral3", split=split_sized, count_rows=rows_by_end_marker),
    VisionSpec("qwen2_vl", split=split_patches, grid=image_grid),
    VisionSpec("qwen2_5_vl", split=split_patches, grid=image_grid),
    VisionSpec("qwen3_vl", encode=deepstack_features, split=split_patches, grid=image_grid, deepstack=True),
    VisionSpec("qwen3_vl_moe", encode=deepstack_features, split=split_patches, grid=image_grid, deepstack=True),
    VisionSpec("qwen3_5", split=split_patches, grid=image_grid),
    VisionSpec("qwen3_5_moe", split=split_patches, grid=image_grid),
)}

# LLaVA with a Pixtral vision tower (no patch merger): images at their own sizes, as Mistral3's.
PIXTRAL_LLAVA = VisionSpec("llava", split=split_sized, count_rows=rows_by_end_marker)


def vision_spec(hf_config: transformers.PretrainedConfig) -> VisionSpec | None:
    """The spec of the config's model type, None for a model that takes no images here
    or a checkpoint of the text model alone (its config declares a causal-LM class, whose
    weights the conditional-generation class would not find)."""
    architectures = getattr(hf_config, "architectures", None) or ()
    if any(name.endswith("ForCausalLM") for name in architectures):
        return None
    vision_type = getattr(getattr(hf_config, "vision_config", None), "model_type", None)
    if hf_config.model_type == "llava" and vision_type == "pixtral":  # Pixtral-12B's layout
        return PIXTRAL_LLAVA
    return VISION_SPECS.get(hf_config.model_type)
