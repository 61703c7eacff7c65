"""The Qwen vision-language family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) end to end: greedy
tokens equal transformers' generate with the same images (float32) through text
prompts, token prompts, chats with image_url parts, chunked prefill that splits an
image, prefix-cache hits, n > 1 and preemption; each image on its own token grid, so
the M-RoPE ids (engine/multimodal/mrope.py) decide the tokens."""

from __future__ import annotations

import base64
import io

import pytest
import torch
import transformers
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny_qwen_vl import build_tiny_qwen_vl
from shardline.engine.multimodal.image_only import load_processor

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# Sizes whose token grids differ in shape (rows x columns): 3x4, 3x2, 4x4, 2x4.
SIZES = [(40, 30), (16, 24), (32, 32), (32, 16)]


def pictures(count: int, seed: int = 7) -> list[Image.Image]:
    """``count`` noise images of the SIZES in turn."""
    generator = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (SIZES[i % 4][1], SIZES[i % 4][0], 3), generator=generator,
                                          dtype=torch.uint8).numpy()) for i in range(count)]


def cases(images: list[Image.Image]) -> list[tuple[str, list[Image.Image]]]:
    return [(f"hi {IMAGE} what is this?", [images[0]]), (f"{IMAGE}Describe it.", [images[1]]),
            (f"two: {IMAGE} and {IMAGE}, compare.", [images[2], images[3]]), (f"look {IMAGE}", [images[3]])]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def qwen_vl(request, tmp_path_factory):
    """(model directory, transformers' greedy generate) of one tiny Qwen-VL type."""
    model_dir = str(build_tiny_qwen_vl(tmp_path_factory.mktemp(request.param), request.param))
    return model_dir, _reference_of(request.param, model_dir)


def _reference_of(model_type: str, model_dir: str):
    """transformers' greedy generate of the tiny model in ``model_dir``."""
    processor = load_processor(model_dir, model_type)
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()

    def reference(text: str, images: list[Image.Image], max_tokens: int = MAX_TOKENS) -> list[int]:
        inputs = processor(text=[text], images=images, return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        return output[0, inputs["input_ids"].shape[1]:].tolist()

    return reference


def _prompts(items):
    return [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in items]


def _tokens(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_changing_the_image_changes_the_reference(qwen_vl):
    _, reference = qwen_vl
    first, second = pictures(2, seed=3)
    second = second.resize(first.size)  # same grid: only the pixels differ
    assert reference(f"hi {IMAGE} what?", [first]) != reference(f"hi {IMAGE} what?", [second])


def test_generate_matches_transformers(qwen_vl):
    model_dir, reference = qwen_vl
    llm = LLM(model_dir, dtype="float32", max_num_seqs=8)
    items = cases(pictures(4))
    outputs = llm.generate(_prompts(items), GREEDY, use_tqdm=False)
    assert _tokens(outputs) == [reference(text, images) for text, images in items]


@pytest.mark.slow
def test_chunked_prefill_and_preemption(qwen_vl):
    # 5 tokens a step: every image's placeholders span several steps; blocks of 4 and a
    # cache of a few blocks: preemption and recompute.
    model_dir, reference = qwen_vl
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=5, max_num_seqs=4, block_size=4,
              kv_cache_memory_bytes=3 * 4 * 2 * 2 * 16 * 4 * 14, max_model_len=56)
    items = cases(pictures(4))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2)
    outputs = llm.generate(_prompts(items), params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for (text, images), output in zip(items, outputs):
        expected = reference(text, images)
        assert [list(c.token_ids) for c in output.outputs] == [expected, expected], text


@pytest.mark.slow
def test_prefix_cache_hits_are_keyed_by_the_image(qwen_vl):
    # The second image has the first's grid: the same tokens, other pixels.
    model_dir, reference = qwen_vl
    llm = LLM(model_dir, dtype="float32", block_size=4)
    first, second = pictures(2, seed=5)
    second = second.resize(first.size)
    text = f"{IMAGE} a long shared question about the picture"
    [a] = llm.generate(_prompts([(text, [first])]), GREEDY, use_tqdm=False)
    [b] = llm.generate(_prompts([(text, [second])]), GREEDY, use_tqdm=False)
    [c] = llm.generate(_prompts([(text + " now", [first])]), GREEDY, use_tqdm=False)
    assert b.num_cached_tokens <= 1 and c.num_cached_tokens >= 12  # b: at most <|vision_start|> before the image
    assert _tokens([a, b, c]) == [reference(text, [first]), reference(text, [second]),
                                  reference(text + " now", [first])]
    # Another question about the first image: a partial hit covers the image's last rows
    # (and the text after them, placed by its grid) with no encoder output needed.
    cache = llm.llm_engine.runner.encoder_cache
    assert cache is not None
    cache.clear()
    encoded, other = cache.num_encoded_images, f"{IMAGE} another question"
    [d] = llm.generate(_prompts([(other, [first])]), GREEDY, use_tqdm=False)
    image_token = llm.llm_engine.runner.model.config.image_token_id
    image_end = max(i for i, token in enumerate(d.prompt_token_ids) if token == image_token) + 1
    assert cache.num_encoded_images == encoded and d.num_cached_tokens >= image_end
    assert _tokens([d]) == [reference(other, [first])]


@pytest.mark.slow
def test_token_prompts_and_chat_expand_like_text_prompts(qwen_vl):
    model_dir, reference = qwen_vl
    llm = LLM(model_dir, dtype="float32")
    tokenizer = llm.get_tokenizer()
    picture = pictures(1, seed=11)[0]
    text = f"hi {IMAGE} what is this?"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    [by_ids] = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [picture]}}, GREEDY,
                            use_tqdm=False)
    assert list(by_ids.outputs[0].token_ids) == reference(text, [picture])
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Caption"}]}]
    [by_chat] = llm.chat(chat, GREEDY, use_tqdm=False)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {
        "type": "text", "text": "Caption"}]}], tokenize=False, add_generation_prompt=True)
    assert list(by_chat.outputs[0].token_ids) == reference(rendered, [picture])


def test_a_video_and_adjacent_images_are_refused(qwen_vl):
    model_dir, _ = qwen_vl
    llm = LLM(model_dir, dtype="float32", check_model=False)
    with pytest.raises(ValueError, match=r"cannot take video input"):
        llm.generate({"prompt": "<|vision_start|><|video_pad|><|vision_end|>", "multi_modal_data": {
            "video": [pictures(1)[0]]}}, GREEDY, use_tqdm=False)
    # Two images in one run of placeholders, by text and by token ids: refused, never
    # given positions transformers would not give.
    adjacent = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|> what?"
    ids = llm.get_tokenizer()(adjacent, add_special_tokens=False).input_ids
    for prompt in ({"prompt": adjacent}, {"prompt_token_ids": ids}):
        with pytest.raises(ValueError, match=r"request '\d+': two images' placeholder tokens are adjacent"):
            llm.generate({**prompt, "multi_modal_data": {"image": pictures(2)}}, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_the_moe_and_hybrid_types_match_transformers(model_type, tmp_path):
    # Qwen3-VL-MoE (deepstack, routed experts), Qwen3.5 and Qwen3.5-MoE (gated delta-net
    # layers keeping recurrent state beside the paged cache), prefill chunked inside images.
    model_dir = str(build_tiny_qwen_vl(tmp_path, model_type))
    reference = _reference_of(model_type, model_dir)
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=5, max_num_seqs=4)
    items = cases(pictures(4))
    assert _tokens(llm.generate(_prompts(items), GREEDY, use_tqdm=False)) == \
        [reference(text, images) for text, images in items]


def test_a_checkpoint_without_an_image_processor_runs_as_text(tmp_path):
    model_dir = build_tiny_qwen_vl(tmp_path, "qwen2_vl")
    (model_dir / "processor_config.json").unlink()  # the image processor's settings
    llm = LLM(str(model_dir), dtype="float32")
    assert llm.llm_engine.multimodal is None
    with pytest.raises(ValueError, match=r"cannot take image input: it is a text-only model"):
        llm.generate({"prompt": f"{IMAGE} hi", "multi_modal_data": {"image": pictures(1)[0]}}, GREEDY,
                     use_tqdm=False)
    [output] = llm.generate("hello there", GREEDY, use_tqdm=False)
    assert len(output.outputs[0].token_ids) > 0
