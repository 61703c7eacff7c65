"""LLaVA end to end: greedy tokens equal transformers' generate with the same images
(float32), through text prompts, token prompts, chunked prefill across an image's
placeholders, n > 1, preemption, the encoder cache and the prefix cache."""

from __future__ import annotations

import pytest

from shardline import LLM, SamplingParams

from .conftest import images

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PROMPTS = ["hi <image> what is this?", "<image> Describe it.", "two: <image> and <image>, compare."]


def _image_prompts(pictures):
    return [("hi <image> what is this?", [pictures[0]]), ("<image> Describe it.", [pictures[1]]),
            ("two: <image> and <image>, compare.", [pictures[2], pictures[3]]),
            ("hi <image> what is this?", [pictures[4]])]


@pytest.fixture(scope="module")
def llava_llm(tiny_llava_dir):
    return LLM(tiny_llava_dir, dtype="float32", max_num_seqs=8)


def test_changing_the_image_changes_the_reference(llava_reference):
    first, second = images(2)
    assert llava_reference("hi <image> what is this?", [first], MAX_TOKENS) != \
        llava_reference("hi <image> what is this?", [second], MAX_TOKENS)


def test_generate_matches_transformers(llava_llm, llava_reference):
    cases = _image_prompts(images(5))
    outputs = llava_llm.generate([{"prompt": text, "multi_modal_data": {"image": pics if len(pics) > 1 else pics[0]}}
                                  for text, pics in cases], GREEDY, use_tqdm=False)
    for (text, pics), output in zip(cases, outputs):
        assert list(output.outputs[0].token_ids) == llava_reference(text, pics, MAX_TOKENS), text
    assert len(outputs[0].prompt_token_ids) == len(llava_llm.get_tokenizer()("hi  what is this?").input_ids) + 16


def test_token_prompts_expand_like_text_prompts(llava_llm):
    tokenizer = llava_llm.get_tokenizer()
    [picture] = images(1)
    text = "hi <image> what is this?"
    [by_text] = llava_llm.generate({"prompt": text, "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    [by_ids] = llava_llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [picture]}}, GREEDY,
                                  use_tqdm=False)
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_chunked_prefill_splits_an_image(tiny_llava_dir, llava_reference):
    # 16 placeholder rows per image, 5 tokens a step: every image spans four steps.
    llm = LLM(tiny_llava_dir, dtype="float32", max_num_batched_tokens=5, max_num_seqs=2, enable_prefix_caching=False)
    cases = _image_prompts(images(5))
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": pics}} for text, pics in cases], GREEDY,
                           use_tqdm=False)
    for (text, pics), output in zip(cases, outputs):
        assert list(output.outputs[0].token_ids) == llava_reference(text, pics, MAX_TOKENS), text


def test_a_repeated_image_is_encoded_once(tiny_llava_dir, llava_reference):
    llm = LLM(tiny_llava_dir, dtype="float32", enable_prefix_caching=False)
    pictures = images(3)
    prompts = [{"prompt": f"{word} <image> now", "multi_modal_data": {"image": pictures[i % 3]}}
               for i, word in enumerate(["one", "two", "three", "four", "five", "six"])]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    cache = llm.llm_engine.runner.encoder_cache
    assert cache is not None and cache.num_encoded_images == 3
    for prompt, output in zip(prompts, outputs):
        expected = llava_reference(prompt["prompt"], [prompt["multi_modal_data"]["image"]], MAX_TOKENS)
        assert list(output.outputs[0].token_ids) == expected



def test_the_encoder_cache_is_bounded_in_bytes(tiny_llava_dir, llava_reference):
    # Room for two images' rows: a third drops the least recently used, which is encoded
    # again, to the same tokens, when it recurs.
    llm = LLM(tiny_llava_dir, dtype="float32", enable_prefix_caching=False, max_num_seqs=1)
    cache = llm.llm_engine.runner.encoder_cache
    assert cache is not None
    cache.capacity_bytes = 2 * 16 * 64 * 4  # 16 rows of the 64-wide text model, float32, per image
    pictures = images(3)
    prompts = [{"prompt": f"{word} <image> now", "multi_modal_data": {"image": pictures[i]}}
               for word, i in (("one", 0), ("two", 1), ("three", 2), ("four", 0))]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert cache.num_encoded_images == 4 and cache.num_bytes == cache.capacity_bytes
    for prompt, output in zip(prompts, outputs):
        expected = llava_reference(prompt["prompt"], [prompt["multi_modal_data"]["image"]], MAX_TOKENS)
        assert list(output.outputs[0].token_ids) == expected

def test_prefix_cache_is_keyed_by_the_image(tiny_llava_dir, llava_reference):
    llm = LLM(tiny_llava_dir, dtype="float32", block_size=4)
    first, second = images(2)
    text = "<image> a long shared question about the picture here"
    [a] = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)
    [b] = llm.generate({"prompt": text, "multi_modal_data": {"image": second}}, GREEDY, use_tqdm=False)
    [c] = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)
    assert b.num_cached_tokens == 0  # same tokens, another image: no block is reused
    assert c.num_cached_tokens >= 16  # the same image: its blocks are
    assert list(a.outputs[0].token_ids) == list(c.outputs[0].token_ids) == llava_reference(text, [first], MAX_TOKENS)
    assert list(b.outputs[0].token_ids) == llava_reference(text, [second], MAX_TOKENS)


def test_a_repeated_image_recomputes_none_of_its_rows(tiny_llava_dir, llava_reference):
    # The image's last rows share a block with each prompt's own question: a partial
    # prefix hit keyed by the image's rows covers them, so the second prompt needs no
    # encoder output (the encoder cache is emptied between the two to show it).
    llm = LLM(tiny_llava_dir, dtype="float32", block_size=8)
    first, second = images(2)
    cache = llm.llm_engine.runner.encoder_cache
    assert cache is not None
    caption, objects = "hi <image> write a caption", "hi <image> list the objects"
    [a] = llm.generate({"prompt": caption, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)
    image_token = llm.get_tokenizer().convert_tokens_to_ids("<image>")
    image_end = max(i for i, token in enumerate(a.prompt_token_ids) if token == image_token) + 1
    assert image_end % 8, "the image ends inside a block"
    cache.clear()
    encoded = cache.num_encoded_images
    [b] = llm.generate({"prompt": objects, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)
    assert cache.num_encoded_images == encoded and b.num_cached_tokens >= image_end
    # Another image in the same place shares no image row.
    [c] = llm.generate({"prompt": objects, "multi_modal_data": {"image": second}}, GREEDY, use_tqdm=False)
    assert cache.num_encoded_images == encoded + 1 and c.num_cached_tokens <= image_end - 16  # the text before it
    assert list(a.outputs[0].token_ids) == llava_reference(caption, [first], MAX_TOKENS)
    assert list(b.outputs[0].token_ids) == llava_reference(objects, [first], MAX_TOKENS)
    assert list(c.outputs[0].token_ids) == llava_reference(objects, [second], MAX_TOKENS)


def test_uuids_name_images_for_the_caches(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, dtype="float32")
    first, second = images(2)
    prompt = {"prompt": "<image> x", "multi_modal_data": {"image": first}, "multi_modal_uuids": {"image": "cat-1"}}
    llm.generate(prompt, GREEDY, use_tqdm=False)
    llm.generate({**prompt, "multi_modal_data": {"image": second}}, GREEDY, use_tqdm=False)
    cache = llm.llm_engine.runner.encoder_cache
    assert cache is not None and cache.num_encoded_images == 1  # the user named both "cat-1"


def test_n_greater_than_one_and_preemption(tiny_llava_dir, llava_reference):
    # A KV cache of a few blocks: running requests are preempted and recomputed.
    llm = LLM(tiny_llava_dir, dtype="float32", block_size=4, kv_cache_memory_bytes=3 * 4 * 2 * 2 * 16 * 4 * 24,
              max_num_seqs=4, max_model_len=64)
    cases = _image_prompts(images(5))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2)
    outputs = llm.generate([{"prompt": t, "multi_modal_data": {"image": p}} for t, p in cases], params,
                           use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for (text, pics), output in zip(cases, outputs):
        expected = llava_reference(text, pics, MAX_TOKENS)
        assert [list(c.token_ids) for c in output.outputs] == [expected, expected]
