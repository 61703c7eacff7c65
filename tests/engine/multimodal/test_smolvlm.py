"""SmolVLM: Idefics3's tiles and markers with SmolVLM's classes, its processor built
without its video processor (no torchvision) and keeping the saved ``image_seq_len``.
Greedy tokens equal transformers' generate (float32) for images of different tile
grids, two per prompt, chunked prefill across them, and token prompts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny_vlm_smolvlm import build_tiny_smolvlm
from shardline.engine.multimodal.image_only import load_processor

from .references import check_cases, greedy_reference

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _pictures() -> list[Image.Image]:
    """Noise images of sizes giving 2x2, 1x2, 2x2 and 2x2 tiles (besides the global view)."""
    generator = torch.Generator().manual_seed(11)
    return [Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
                            .numpy()) for height, width in ((30, 40), (20, 60), (16, 16), (40, 30))]


CASES = [("a picture: <image> what is it?", [0]), ("<image> and <image> compare", [1, 0]), ("hi <image> x", [3]),
         ("small <image> one", [2]), ("<image><image> two", [2, 1])]


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory) -> str:
    return str(build_tiny_smolvlm(tmp_path_factory.mktemp("tiny-smolvlm")))


@pytest.fixture(scope="module")
def processor(smolvlm_dir) -> Any:
    return load_processor(smolvlm_dir, "smolvlm")


@pytest.fixture(scope="module")
def reference(smolvlm_dir, processor):
    return greedy_reference(smolvlm_dir, processor, MAX_TOKENS)


def _check(llm: LLM, reference) -> None:
    check_cases(llm, reference, GREEDY, _pictures(), CASES)


def test_the_processor_keeps_the_saved_image_seq_len(processor):
    assert type(processor).__name__ == "SmolVLMProcessor"
    assert processor.image_seq_len == 4  # (32 / 8 / 2)^2, not the class's default 169
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    counts = [int((processor(text="hi <image> x", images=[picture], return_tensors="pt")["input_ids"] == image_id)
                   .sum()) for picture in _pictures()[:2]]
    assert counts == [5 * 4, 3 * 4]  # 2x2 and 1x2 tiles and the global view, 4 rows each


def test_the_reference_depends_on_the_image(reference):
    pictures = _pictures()
    assert reference("hi <image> x", [pictures[0]]) != reference("hi <image> x", [pictures[3]])


def test_generate_matches_transformers(smolvlm_dir, reference):
    llm = LLM(smolvlm_dir, dtype="float32", max_num_seqs=8)
    _check(llm, reference)


def test_chunked_prefill_splits_tiles_and_images(smolvlm_dir, reference):
    llm = LLM(smolvlm_dir, dtype="float32", max_num_batched_tokens=7, max_num_seqs=2, enable_prefix_caching=False)
    _check(llm, reference)


def test_token_prompts_expand_like_text_prompts(smolvlm_dir):
    llm = LLM(smolvlm_dir, dtype="float32")
    pictures = _pictures()
    text = "<image> and <image> compare"
    [by_text] = llm.generate({"prompt": text, "multi_modal_data": {"image": pictures[:2]}}, GREEDY, use_tqdm=False)
    ids = llm.get_tokenizer()(text, add_special_tokens=False).input_ids
    [by_ids] = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": pictures[:2]}}, GREEDY,
                            use_tqdm=False)
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_chat_matches_transformers(smolvlm_dir, processor, reference):
    llm = LLM(smolvlm_dir, dtype="float32")
    picture = _pictures()[1]
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture},
                                         {"type": "text", "text": "what is it?"}]}]
    [output] = llm.chat([chat], GREEDY, use_tqdm=False)
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is it?"}]}], tokenize=False, add_generation_prompt=True)
    assert "<image>" in text
    assert list(output.outputs[0].token_ids) == reference(text, [picture])
