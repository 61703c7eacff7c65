"""The processor step's shortcuts give the model's processor's own output, bit for bit:
the shorter path through PIL image processors (engine/multimodal/fast_pixels.py) and the
spliced text expansion (engine/multimodal/expansion.py), for each family that takes
them, and the processor's own path for the families that do not."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from shardline.engine.config import EngineConfig
from shardline.engine.model.tiny_qwen_vl import build_tiny_qwen_vl
from shardline.engine.model.tiny_vlm import build_tiny_llava, build_tiny_llava_next
from shardline.engine.model.tiny_vlm_gemma3 import build_tiny_gemma3
from shardline.engine.model.tiny_vlm_idefics3 import build_tiny_idefics3
from shardline.engine.model.tiny_vlm_pixtral import build_tiny_mistral3
from shardline.engine.multimodal.fast_pixels import FastPixels, takes_fast_path
from shardline.engine.multimodal.image_only import load_processor
from shardline.engine.multimodal.processor import MultimodalProcessor

# builder, prompt with one placeholder, whether the image processor takes the short
# path, whether the text expansion splices.
FAMILIES: dict[str, tuple[Callable[[Path], Path], str, bool, bool]] = {
    "llava": (partial(build_tiny_llava, image_size=336, patch_size=14), "<|user|><image> Describe it.", True, True),
    "llava_next": (build_tiny_llava_next, "<|user|><image> Describe it.", False, True),
    "qwen2_vl": (build_tiny_qwen_vl, "<|vision_start|><|image_pad|><|vision_end|> Describe it.", False, True),
    "gemma3": (build_tiny_gemma3, "<start_of_image> Describe it.", False, False),
    "idefics3": (build_tiny_idefics3, "<image> Describe it.", False, False),
    "mistral3": (build_tiny_mistral3, "[IMG] Describe it.", False, False),
}
SIZES = ((640, 480), (480, 640), (512, 512), (333, 251), (64, 48))


def photos(sizes: tuple[tuple[int, int], ...] = SIZES, seed: int = 0) -> list[Image.Image]:
    generator = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
                            .numpy()) for width, height in sizes]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, FAMILIES[request.param][0](tmp_path_factory.mktemp(request.param))


def processor_of(model_dir: Path) -> Any:
    """The model's processor as the engine loads it (image-only where transformers'
    needs torchvision)."""
    return load_processor(str(model_dir), transformers.AutoConfig.from_pretrained(model_dir).model_type)


def assert_same(ours: Any, theirs: Any) -> None:
    assert set(ours.keys()) == set(theirs.keys())
    for key, value in theirs.items():
        assert isinstance(ours[key], torch.Tensor) and ours[key].dtype == value.dtype, key
        assert torch.equal(ours[key], value), key


def test_pil_image_processors_give_their_own_pixels(family):
    name, model_dir = family
    image_processor = processor_of(model_dir).image_processor
    assert takes_fast_path(image_processor) == FAMILIES[name][2], type(image_processor).__name__
    fast = FastPixels(image_processor)
    pictures = photos()
    for picture in [*pictures, pictures[0].convert("L"), pictures[1].convert("RGBA")]:
        assert_same(fast([picture], return_tensors="pt"), image_processor([picture], return_tensors="pt"))
    assert_same(fast(pictures[:1] * 2 + pictures[2:3], return_tensors="pt"),
                image_processor(pictures[:1] * 2 + pictures[2:3], return_tensors="pt"))


def test_the_short_path_reads_every_setting():
    """A changed setting (a call's own, or the processor's) changes the path's output as
    it changes the processor's; a crop larger than the resized image (which the
    processor pads) and settings the path does not read go to the processor."""
    image_processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 40}, crop_size=32)
    fast = FastPixels(image_processor)
    picture = photos(((90, 70),))[0]
    for kwargs in ({}, {"do_normalize": False}, {"do_rescale": False}, {"do_rescale": False, "do_normalize": False},
                   {"image_mean": [0.1, 0.2, 0.3], "image_std": 0.5}, {"crop_size": {"height": 48, "width": 64}},
                   {"size": {"height": 24, "width": 40}, "do_center_crop": False}, {"resample": 0},
                   {"do_resize": False}, {"do_pad": True, "pad_size": {"height": 64, "width": 64}}):
        assert_same(fast([picture], return_tensors="pt", **kwargs),
                    image_processor([picture], return_tensors="pt", **kwargs))
    plain = fast([picture], return_tensors="pt")["pixel_values"]
    assert not torch.equal(plain, fast([picture], return_tensors="pt", do_normalize=False)["pixel_values"])


def test_prompts_expand_as_the_processor_expands_them(family):
    """Text prompts through the engine's processor step, their image sizes first seen
    and seen again (the spliced expansion and the short path then answer), give the
    processor's own token ids and pixel tensors; where the text splices, the prompt's
    tokens as a token prompt expand alike."""
    name, model_dir = family
    text = FAMILIES[name][1]
    config = EngineConfig(model=str(model_dir), mm_processor_cache_gb=0)
    engine_processor = MultimodalProcessor.load(config, transformers.AutoConfig.from_pretrained(model_dir))
    assert engine_processor is not None
    reference = processor_of(model_dir)
    pictures = photos(SIZES[:3]) + photos(SIZES[:3], seed=1)  # each size seen twice
    for index, picture in enumerate(pictures):
        expected = reference(text=[text], images=[picture], return_tensors="pt")
        ours = engine_processor.process(str(index), {"prompt": text}, {"image": [picture]})
        assert ours.prompt_token_ids == expected["input_ids"][0].tolist(), (name, index)
        (image,) = ours.images
        (pixels,) = engine_processor._split(expected, [image.num_rows])
        assert_same(image.pixel_inputs, pixels)
        if FAMILIES[name][3]:
            token_ids = reference.tokenizer(text)["input_ids"]
            as_tokens = engine_processor.process(str(index), {"prompt_token_ids": token_ids}, {"image": [picture]})
            assert as_tokens.prompt_token_ids == ours.prompt_token_ids
    spliced = len(engine_processor.expansions.by_size) == len(SIZES[:3])
    assert engine_processor.expansions.splices == spliced == FAMILIES[name][3], name
