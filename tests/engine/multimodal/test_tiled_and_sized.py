"""Models whose processors give each image its own number of rows, end to end: Idefics3
and SmolVLM (each image cut into tiles plus a global view, every tile a run of rows
after its markers; SmolVLM's processor built without its video processor and keeping
the saved ``image_seq_len``), Mistral3 (Pixtral tower with a patch merger) and LLaVA
with a Pixtral tower (Pixtral-12B's layout): each image at its own size, expanded into
rows of ``[IMG]`` ended by ``[IMG_BREAK]`` / ``[IMG_END]`` by the torchvision-free
processor (engine/multimodal/pixtral.py).

For each: greedy tokens equal transformers' generate (float32) for images of different
sizes (different tile grids or row counts), two per prompt, chunked prefill across
tiles and images, token prompts and chat."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny_vlm_idefics3 import build_tiny_idefics3
from shardline.engine.model.tiny_vlm_pixtral import build_tiny_mistral3, build_tiny_pixtral_llava
from shardline.engine.model.tiny_vlm_smolvlm import build_tiny_smolvlm
from shardline.engine.multimodal.image_only import load_processor
from shardline.engine.multimodal.pixtral import PixtralImageProcessor

from .references import check_cases, greedy_reference

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@dataclass(frozen=True)
class Family:
    """One architecture's tiny builder, its prompt's image token, its test images
    (seed, (height, width) each) and its prompts (text, indices of the images)."""

    build: Callable[[Path], Path]
    image_token: str
    seed: int
    sizes: tuple[tuple[int, int], ...]
    cases: tuple[tuple[str, tuple[int, ...]], ...]

    def pictures(self) -> list[Image.Image]:
        generator = torch.Generator().manual_seed(self.seed)
        return [Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
                                .numpy()) for height, width in self.sizes]

    def text(self, template: str) -> str:
        return template.replace("<image>", self.image_token)


def _cases(*cases: tuple[str, tuple[int, ...]]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return cases


# Idefics3's sizes give 2x2, 2x1 and no tiles besides the global view; SmolVLM's 2x2,
# 1x2, 2x2 and 2x2; Pixtral's differ in size and aspect ratio (one size repeated).
FAMILIES = {
    "idefics3": Family(build_tiny_idefics3, "<image>", 7, ((30, 40), (20, 60), (16, 16), (40, 30)), _cases(
        ("a picture: <image> what is it?", (0,)), ("<image> and <image> compare", (1, 2)), ("hi <image> x", (3,)),
        ("small <image> one", (2,)))),
    "smolvlm": Family(build_tiny_smolvlm, "<image>", 11, ((30, 40), (20, 60), (16, 16), (40, 30)), _cases(
        ("a picture: <image> what is it?", (0,)), ("<image> and <image> compare", (1, 0)), ("hi <image> x", (3,)),
        ("small <image> one", (2,)), ("<image><image> two", (2, 1)))),
    **{name: Family(build, "[IMG]", 5, ((30, 40), (20, 60), (48, 48), (40, 30), (30, 40)), _cases(
        ("a picture: <image> what is it?", (0,)), ("<image> and <image> compare", (1, 2)), ("hi <image> x", (3,)),
        ("two <image><image> same size", (0, 4)), ("small <image> one", (2,))))
       for name, build in (("mistral3", build_tiny_mistral3), ("pixtral_llava", build_tiny_pixtral_llava))},
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> tuple[str, Family]:
    return request.param, FAMILIES[request.param]


@pytest.fixture(scope="module")
def model_dir(family, tmp_path_factory) -> str:
    name, spec = family
    return str(spec.build(tmp_path_factory.mktemp(f"tiny-{name}")))


@pytest.fixture(scope="module")
def processor(model_dir) -> Any:
    return load_processor(model_dir, transformers.AutoConfig.from_pretrained(model_dir).model_type)


@pytest.fixture(scope="module")
def reference(model_dir, processor):
    return greedy_reference(model_dir, processor, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, dtype="float32", max_num_seqs=8)


def _check(llm: LLM, reference, spec: Family) -> None:
    cases = [(spec.text(text), list(indices)) for text, indices in spec.cases]
    check_cases(llm, reference, GREEDY, spec.pictures(), cases)


def test_generate_matches_transformers(family, llm, reference):
    _, spec = family
    pictures = spec.pictures()
    text = spec.text("hi <image> x")
    assert reference(text, [pictures[0]]) != reference(text, [pictures[3]])  # the image changes the tokens
    _check(llm, reference, spec)


@pytest.mark.slow
def test_chunked_prefill_splits_tiles_and_images(family, model_dir, reference):
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=7, max_num_seqs=2, enable_prefix_caching=False)
    _check(llm, reference, family[1])


@pytest.mark.slow
def test_token_prompts_expand_like_text_prompts(family, llm):
    _, spec = family
    pictures = spec.pictures()[:2]
    text = spec.text("<image> and <image> compare")
    [by_text] = llm.generate({"prompt": text, "multi_modal_data": {"image": pictures}}, GREEDY, use_tqdm=False)
    ids = llm.get_tokenizer()(text, add_special_tokens=False).input_ids
    [by_ids] = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": pictures}}, GREEDY,
                            use_tqdm=False)
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


@pytest.mark.slow
def test_chat_matches_transformers(family, llm, processor, reference):
    _, spec = family
    picture = spec.pictures()[1]
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture},
                                         {"type": "text", "text": "what is it?"}]}]
    [output] = llm.chat([chat], GREEDY, use_tqdm=False)
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is it?"}]}], tokenize=False, add_generation_prompt=True)
    assert spec.image_token in text
    assert list(output.outputs[0].token_ids) == reference(text, [picture])


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"], indirect=True)
def test_tiles_give_rows_per_tile_and_global_view(family, processor, llm):
    name, spec = family
    if name == "smolvlm":
        assert type(processor).__name__ == "SmolVLMProcessor"
        assert processor.image_seq_len == 4  # (32 / 8 / 2)^2, not the class's default 169
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    counts = [int((processor(text="hi <image> x", images=[picture], return_tensors="pt")["input_ids"] == image_id)
                   .sum()) for picture in spec.pictures()[:2]]
    # 2x2 tiles and the global view, then 2x1 (1x2) tiles and the global view, 4 rows each.
    assert counts == [5 * 4, 3 * 4]
    [output] = llm.generate({"prompt": "hi <image> x", "multi_modal_data": {"image": spec.pictures()[0]}}, GREEDY,
                            use_tqdm=False)
    assert output.prompt_token_ids.count(image_id) == 5 * 4


@pytest.mark.parametrize("family", ["mistral3", "pixtral_llava"], indirect=True)
def test_the_expansion_follows_the_image_processors_sizes(family, processor):
    _, spec = family
    assert isinstance(processor, PixtralImageProcessor)
    assert processor.patch_size * processor.spatial_merge_size == 8  # a placeholder per 8 x 8 pixels
    picture = spec.pictures()[1]
    pixels = transformers.PixtralImageProcessorPil(size={"longest_edge": 48}, patch_size={"height": 8, "width": 8})(
        [picture], return_tensors="pt")
    height, width = pixels["image_sizes"][0].tolist()
    inputs = processor(text="[IMG]", images=[picture], return_tensors="pt", add_special_tokens=False)
    tokens = processor.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
    row = ["[IMG]"] * (width // 8)
    assert tokens == [*(row + ["[IMG_BREAK]"]) * (height // 8 - 1), *row, "[IMG_END]"]
    assert torch.equal(inputs["pixel_values"], pixels["pixel_values"])
