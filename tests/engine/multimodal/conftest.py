from __future__ import annotations

import pytest
import torch
import transformers
from PIL import Image

from shardline.engine.model.tiny_vlm import build_tiny_llava


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory) -> str:
    """A tiny random LLaVA-shaped model with its processor, built once."""
    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava")))


@pytest.fixture(scope="session")
def llava_reference(tiny_llava_dir):
    """Greedy tokens of transformers' own generate, float32, one prompt at a time."""
    processor = transformers.AutoProcessor.from_pretrained(tiny_llava_dir)
    model = transformers.AutoModelForImageTextToText.from_pretrained(tiny_llava_dir, dtype=torch.float32).eval()

    def generate(text: str, images: list[Image.Image], max_tokens: int) -> list[int]:
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        return output[0, inputs["input_ids"].shape[1]:].tolist()

    return generate


def images(count: int, size: tuple[int, int] = (40, 30)) -> list[Image.Image]:
    """``count`` different images: noise of seeds 0.. (RGB)."""
    generator = torch.Generator().manual_seed(1234)
    return [Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
                            .numpy()) for _ in range(count)]
