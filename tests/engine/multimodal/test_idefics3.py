"""Idefics3: each image cut into tiles plus a global view, every tile one run of rows
after its markers, the pixel-shuffle connector. Greedy tokens equal transformers'
generate (float32) for images of different sizes (so different tile counts), several
per prompt, chunked prefill across them, and token prompts."""

from __future__ import annotations

import pytest
import torch
import transformers
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny_vlm_idefics3 import build_tiny_idefics3

from .references import check_cases, greedy_reference

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _pictures() -> list[Image.Image]:
    """Noise images of sizes giving 2x2, 2x1 and no tiles (besides the global view)."""
    generator = torch.Generator().manual_seed(7)
    return [Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
                            .numpy()) for height, width in ((30, 40), (20, 60), (16, 16), (40, 30))]


CASES = [("a picture: <image> what is it?", [0]), ("<image> and <image> compare", [1, 2]), ("hi <image> x", [3]),
         ("small <image> one", [2])]


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory) -> str:
    return str(build_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3")))


@pytest.fixture(scope="module")
def reference(idefics3_dir):
    processor = transformers.AutoProcessor.from_pretrained(idefics3_dir)
    return greedy_reference(idefics3_dir, processor, MAX_TOKENS)


def _check(llm: LLM, reference) -> None:
    check_cases(llm, reference, GREEDY, _pictures(), CASES)


def test_the_reference_depends_on_the_image(reference):
    pictures = _pictures()
    assert reference("hi <image> x", [pictures[0]]) != reference("hi <image> x", [pictures[3]])


def test_generate_matches_transformers(idefics3_dir, reference):
    llm = LLM(idefics3_dir, dtype="float32", max_num_seqs=8)
    _check(llm, reference)
    [output] = llm.generate({"prompt": "hi <image> x", "multi_modal_data": {"image": _pictures()[0]}}, GREEDY,
                            use_tqdm=False)
    assert len(output.prompt_token_ids) > 5 * 4  # 2x2 tiles and the global view, 4 rows each


def test_chunked_prefill_splits_tiles_and_images(idefics3_dir, reference):
    llm = LLM(idefics3_dir, dtype="float32", max_num_batched_tokens=7, max_num_seqs=2, enable_prefix_caching=False)
    _check(llm, reference)


def test_token_prompts_expand_like_text_prompts(idefics3_dir):
    llm = LLM(idefics3_dir, dtype="float32")
    pictures = _pictures()
    text = "<image> and <image> compare"
    [by_text] = llm.generate({"prompt": text, "multi_modal_data": {"image": pictures[:2]}}, GREEDY, use_tqdm=False)
    ids = llm.get_tokenizer()(text, add_special_tokens=False).input_ids
    [by_ids] = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": pictures[:2]}}, GREEDY,
                            use_tqdm=False)
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
