"""The decoder's layers of a vision-language model are its text model's, even where its
vision tower holds more layers (engine/surgery.py's decoder_layers)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny_vlm import build_tiny_llava
from shardline.engine.surgery import decoder_layers

from .conftest import images

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def deep_vision_dir(tmp_path_factory) -> str:
    """A tiny LLaVA whose vision tower has 5 layers and whose text model has 2."""
    return str(build_tiny_llava(tmp_path_factory.mktemp("deep-vision-llava"), num_text_layers=2,
                                num_vision_layers=5))


def test_decoder_layers_are_the_text_models(deep_vision_dir):
    model = transformers.AutoModelForImageTextToText.from_pretrained(deep_vision_dir, dtype=torch.float32)
    name, layers = decoder_layers(model)
    assert name == "model.language_model.layers"
    assert layers is model.model.language_model.layers and len(layers) == 2
    assert max(len(m) for m in model.model.vision_tower.modules() if isinstance(m, torch.nn.ModuleList)) == 5


def test_a_model_without_get_decoder_takes_its_longest_module_list():
    model = torch.nn.Module()
    model.short = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    model.long = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    name, layers = decoder_layers(model)
    assert name == "long" and layers is model.long


def test_generate_matches_transformers_with_a_deeper_vision_tower(deep_vision_dir):
    processor = transformers.AutoProcessor.from_pretrained(deep_vision_dir)
    model: Any = transformers.AutoModelForImageTextToText.from_pretrained(deep_vision_dir, dtype=torch.float32).eval()
    text = "look: <image> what is it?"
    pictures = images(2)
    expected = []
    for picture in pictures:
        inputs = processor(text=text, images=[picture], return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        expected.append(output[0, inputs["input_ids"].shape[1]:].tolist())
    assert expected[0] != expected[1]  # the image changes the reference's tokens
    llm = LLM(deep_vision_dir, dtype="float32")
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": p}} for p in pictures],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
