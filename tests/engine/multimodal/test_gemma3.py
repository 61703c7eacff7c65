"""Gemma 3 with images: its image rows attend to each other both ways (transformers'
mask: causal, plus full attention among the rows of one image), in sliding-window and
full-attention layers alike. Greedy tokens equal transformers' generate (float32)
through one and several images, chunked prefill (the scheduler never splits an image),
token prompts, chats and a prefix-cache hit; an image longer than the step's token
budget is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.engine.core.scheduler import PromptTooLongError
from shardline.engine.model.tiny_vlm_gemma3 import build_tiny_gemma3

from .conftest import images
from .references import greedy_reference

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
IMAGE = "<start_of_image>"
CASES = [("hi <start_of_image> x", 1), ("a picture: <start_of_image> what is it?", 1),
         (f"{IMAGE} and {IMAGE} compare them", 2), ("one more <start_of_image>", 1)]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> str:
    return str(build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3")))


@pytest.fixture(scope="module")
def reference(gemma3_dir):
    """transformers' greedy tokens, float32, one prompt at a time (``causal=True``:
    without the token types that make image rows attend both ways)."""
    return greedy_reference(gemma3_dir, transformers.AutoProcessor.from_pretrained(gemma3_dir), MAX_TOKENS)


def _prompts(pictures: list[Image.Image]) -> list[tuple[str, list[Image.Image]]]:
    cases, used = [], 0
    for text, count in CASES:
        cases.append((text, pictures[used:used + count]))
        used += count
    return cases


def _check(llm: LLM, reference, cases) -> None:
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": pics}} for text, pics in cases], GREEDY,
                           use_tqdm=False)
    for (text, pics), output in zip(cases, outputs):
        assert list(output.outputs[0].token_ids) == reference(text, pics), text


def test_the_reference_depends_on_the_image_and_its_two_way_mask(reference):
    first, second = images(2)
    text = "hi <start_of_image> x"
    assert reference(text, [first]) != reference(text, [second])
    assert any(reference(t, pics) != reference(t, pics, causal=True) for t, pics in _prompts(images(5)))


def test_generate_matches_transformers(gemma3_dir, reference):
    _check(LLM(gemma3_dir, dtype="float32", max_num_seqs=8), reference, _prompts(images(5)))


def test_chunked_prefill_keeps_each_image_whole(gemma3_dir, reference):
    # 16 rows per image and 20 tokens a step: a chunk that would end inside an image
    # ends before it, and the image runs whole in the next step.
    llm = LLM(gemma3_dir, dtype="float32", max_num_batched_tokens=20, max_num_seqs=2, enable_prefix_caching=False)
    _check(llm, reference, _prompts(images(5)))


@pytest.mark.slow
def test_token_prompts_and_chats_expand_the_image_marker(gemma3_dir, reference):
    llm = LLM(gemma3_dir, dtype="float32")
    [picture] = images(1)
    text = "a picture: <start_of_image> what is it?"
    ids = llm.get_tokenizer()(text).input_ids
    [by_ids] = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": picture}}, GREEDY,
                            use_tqdm=False)
    assert list(by_ids.outputs[0].token_ids) == reference(text, [picture])
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture},
                                         {"type": "text", "text": "what is it?"}]}]
    [by_chat] = llm.chat(chat, GREEDY, use_tqdm=False)
    rendered = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert isinstance(rendered, str)
    assert list(by_chat.outputs[0].token_ids) == reference(rendered.removeprefix("<|bos|>"), [picture])


@pytest.mark.slow
def test_a_prefix_hit_on_the_same_image(gemma3_dir, reference):
    llm = LLM(gemma3_dir, dtype="float32", block_size=4)
    first, second = images(2)
    text = "<start_of_image> a long shared question about the picture here"
    outputs = [llm.generate({"prompt": text, "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)[0]
               for picture in (first, second, first)]
    assert outputs[1].num_cached_tokens < 4 and outputs[2].num_cached_tokens >= 16
    for output, picture in zip(outputs, (first, second, first)):
        assert list(output.outputs[0].token_ids) == reference(text, [picture])
    # Another question about the first image: a partial hit covers the image's last rows
    # (which attend both ways) up to the question, with no encoder output needed.
    cache = llm.llm_engine.runner.encoder_cache
    assert cache is not None
    cache.clear()
    encoded, other = cache.num_encoded_images, "<start_of_image> another question"
    [again] = llm.generate({"prompt": other, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)
    image_token = llm.llm_engine.runner.model.config.image_token_id
    image_end = max(i for i, token in enumerate(again.prompt_token_ids) if token == image_token) + 1
    assert cache.num_encoded_images == encoded and again.num_cached_tokens >= image_end and image_end % 4
    assert list(again.outputs[0].token_ids) == reference(other, [first])


def test_pan_and_scan_crops_are_more_views_of_the_image(gemma3_dir):
    # mm_processor_kwargs as vLLM's: a wide or tall image gets crops (more views between
    # their own markers, with text between), a square one none; tokens as transformers'
    # with the same processor settings, which differ from those without crops.
    settings = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}
    processor = transformers.AutoProcessor.from_pretrained(gemma3_dir)
    model: Any = transformers.AutoModelForImageTextToText.from_pretrained(gemma3_dir, dtype=torch.float32).eval()

    def reference(text: str, pictures: list[Image.Image], **kwargs: Any) -> list[int]:
        inputs = processor(text=text, images=pictures, return_tensors="pt", **kwargs)
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        return output[0, inputs["input_ids"].shape[1]:].tolist()

    [wide] = images(1, size=(120, 40))
    [tall] = images(1, size=(30, 70))
    [square] = images(1, size=(40, 40))
    cases = [("hi <start_of_image> x", [wide]), (f"{IMAGE} and {IMAGE} compare", [square, tall]),
             (f"a {IMAGE} b {IMAGE} c", [tall, wide])]
    llm = LLM(gemma3_dir, dtype="float32", mm_processor_kwargs=settings)
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": pics}} for text, pics in cases], GREEDY,
                           use_tqdm=False)
    for (text, pics), output in zip(cases, outputs):
        expected = reference(text, pics, **settings)
        assert list(output.outputs[0].token_ids) == expected != reference(text, pics), text
    cache = llm.llm_engine.runner.encoder_cache
    assert cache is not None and cache.num_encoded_images == 3  # an image and its crops: one entry
    # A token prompt's marker expands to the same views and text.
    ids = llm.get_tokenizer()(cases[0][0], add_special_tokens=False).input_ids
    [by_ids] = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [wide]}}, GREEDY, use_tqdm=False)
    assert by_ids.prompt_token_ids == outputs[0].prompt_token_ids
    assert by_ids.outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_an_image_longer_than_the_token_budget_is_refused(gemma3_dir):
    llm = LLM(gemma3_dir, dtype="float32", max_num_batched_tokens=12, check_model=False)
    with pytest.raises(PromptTooLongError, match="max_num_batched_tokens=12"):
        llm.generate({"prompt": "hi <start_of_image> x", "multi_modal_data": {"image": images(1)[0]}}, GREEDY,
                     use_tqdm=False)


@pytest.mark.slow
def test_the_triton_backend_hands_image_steps_to_the_torch_path(gemma3_dir, reference, monkeypatch):
    # Under TRITON_INTERPRET=1 on CPU: decode steps run the Triton kernel, a step with
    # image rows attending both ways runs on the torch path (TritonBackend.build_context).
    import shardline.engine.kernels as kernels

    calls: list[int] = []
    original = kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    llm = LLM(gemma3_dir, dtype="float32", attention_backend="triton", check_model=False)
    cases = _prompts(images(5))[:2]
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": pics}} for text, pics in cases], GREEDY,
                           use_tqdm=False)
    for (text, pics), output in zip(cases, outputs):
        assert list(output.outputs[0].token_ids) == reference(text, pics), text
    assert calls  # the kernel ran the decode steps
