"""Mistral3 (Pixtral vision tower, patch merger) and LLaVA with a Pixtral tower
(Pixtral-12B's layout, no merger): each image at its own size, expanded
into rows of ``[IMG]`` ended by ``[IMG_BREAK]`` / ``[IMG_END]`` by the torchvision-free
processor (engine/multimodal/pixtral.py). Its expansion follows transformers'
PixtralImageProcessorPil's sizes; greedy tokens equal transformers' generate (float32)
for images of different sizes, two per prompt, chunked prefill across them, and token
prompts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny_vlm_pixtral import build_tiny_mistral3, build_tiny_pixtral_llava
from shardline.engine.multimodal.image_only import load_processor
from shardline.engine.multimodal.pixtral import PixtralImageProcessor

from .references import check_cases, greedy_reference

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _pictures() -> list[Image.Image]:
    """Noise images of different sizes and aspect ratios (one repeated size)."""
    generator = torch.Generator().manual_seed(5)
    return [Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
                            .numpy()) for height, width in ((30, 40), (20, 60), (48, 48), (40, 30), (30, 40))]


CASES = [("a picture: [IMG] what is it?", [0]), ("[IMG] and [IMG] compare", [1, 2]), ("hi [IMG] x", [3]),
         ("two [IMG][IMG] same size", [0, 4]), ("small [IMG] one", [2])]


BUILDERS = {"mistral3": build_tiny_mistral3, "llava": build_tiny_pixtral_llava}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def mistral3_dir(request, tmp_path_factory) -> str:
    return str(BUILDERS[request.param](tmp_path_factory.mktemp(f"tiny-pixtral-{request.param}")))


@pytest.fixture(scope="module")
def processor(mistral3_dir) -> Any:
    return load_processor(mistral3_dir, transformers.AutoConfig.from_pretrained(mistral3_dir).model_type)


@pytest.fixture(scope="module")
def reference(mistral3_dir, processor):
    return greedy_reference(mistral3_dir, processor, MAX_TOKENS)


def _check(llm: LLM, reference) -> None:
    check_cases(llm, reference, GREEDY, _pictures(), CASES)


def test_the_expansion_follows_the_image_processors_sizes(processor):
    assert isinstance(processor, PixtralImageProcessor)
    assert processor.patch_size * processor.spatial_merge_size == 8  # a placeholder per 8 x 8 pixels
    picture = _pictures()[1]
    pixels = transformers.PixtralImageProcessorPil(size={"longest_edge": 48}, patch_size={"height": 8, "width": 8})(
        [picture], return_tensors="pt")
    height, width = pixels["image_sizes"][0].tolist()
    inputs = processor(text="[IMG]", images=[picture], return_tensors="pt", add_special_tokens=False)
    tokens = processor.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
    row = ["[IMG]"] * (width // 8)
    assert tokens == [*(row + ["[IMG_BREAK]"]) * (height // 8 - 1), *row, "[IMG_END]"]
    assert torch.equal(inputs["pixel_values"], pixels["pixel_values"])


def test_the_reference_depends_on_the_image(reference):
    pictures = _pictures()
    assert reference("hi [IMG] x", [pictures[0]]) != reference("hi [IMG] x", [pictures[3]])


def test_generate_matches_transformers(mistral3_dir, reference):
    llm = LLM(mistral3_dir, dtype="float32", max_num_seqs=8)
    _check(llm, reference)


def test_chunked_prefill_splits_images(mistral3_dir, reference):
    llm = LLM(mistral3_dir, dtype="float32", max_num_batched_tokens=7, max_num_seqs=2, enable_prefix_caching=False)
    _check(llm, reference)


def test_token_prompts_expand_like_text_prompts(mistral3_dir):
    llm = LLM(mistral3_dir, dtype="float32")
    pictures = _pictures()
    text = "[IMG] and [IMG] compare"
    [by_text] = llm.generate({"prompt": text, "multi_modal_data": {"image": pictures[:2]}}, GREEDY, use_tqdm=False)
    ids = llm.get_tokenizer()(text, add_special_tokens=False).input_ids
    [by_ids] = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": pictures[:2]}}, GREEDY,
                            use_tqdm=False)
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_chat_matches_transformers(mistral3_dir, processor, reference):
    llm = LLM(mistral3_dir, dtype="float32")
    picture = _pictures()[1]
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture},
                                         {"type": "text", "text": "what is it?"}]}]
    [output] = llm.chat([chat], GREEDY, use_tqdm=False)
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is it?"}]}], tokenize=False, add_generation_prompt=True)
    assert "[IMG]" in text
    assert list(output.outputs[0].token_ids) == reference(text, [picture])
