"""The processed-pixels cache (engine/multimodal/pixel_cache.py): a recurring image is
preprocessed once, its answer equals the image processor's, and the engine's tokens
with it equal transformers' generate."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.config import ConfigError, EngineConfig
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.multimodal.pixel_cache import PixelCache

from .conftest import images

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def image_processor(tiny_llava_dir):
    return transformers.AutoProcessor.from_pretrained(tiny_llava_dir).image_processor


def test_a_declared_image_is_processed_once(image_processor):
    first, second = images(2, size=(50, 40))
    cache = PixelCache(image_processor, 1 << 30)
    cache.declare({id(first): "a", id(second): "b"})
    expected = image_processor([first], return_tensors="pt")["pixel_values"]
    answers = [cache([first], return_tensors="pt")["pixel_values"] for _ in range(3)]
    assert cache.num_hits == 2 and len(cache.entries) == 1
    for answer in answers:
        assert torch.equal(answer, expected)
    answers[1].fill_(7.0)  # a processor changing what it was handed never changes the cache
    assert torch.equal(cache([first], return_tensors="pt")["pixel_values"], expected)
    # Other arguments, another nesting, another image: computed, not answered.
    cache([first], return_tensors="pt", do_normalize=False)
    cache([[first]], return_tensors="pt")
    other = cache([second], return_tensors="pt")["pixel_values"]
    assert cache.num_hits == 3 and len(cache.entries) == 4
    assert torch.equal(other, image_processor([second], return_tensors="pt")["pixel_values"])


def test_shared_answers_equal_the_processor_and_are_cached_once(image_processor):
    first, second = images(2, size=(50, 40))
    cache = PixelCache(image_processor, 1 << 30)
    cache.declare({id(first): "a", id(second): "b"})
    expected = image_processor([first], return_tensors="pt")["pixel_values"]
    answers = [cache.shared([first], return_tensors="pt")["pixel_values"] for _ in range(2)]
    assert cache.num_hits == 1 and len(cache.entries) == 1 and cache.num_bytes == expected.numel() * 4
    assert all(torch.equal(answer, expected) for answer in answers)
    # A call after shared answers still gets the processor's values, in a copy of its own.
    copied = cache([first], return_tensors="pt")["pixel_values"]
    assert torch.equal(copied, expected) and copied.data_ptr() != answers[0].data_ptr()
    assert torch.equal(cache.shared([second], return_tensors="pt")["pixel_values"],
                       image_processor([second], return_tensors="pt")["pixel_values"])


def test_undeclared_and_several_images_pass_through(image_processor):
    first, second = images(2)
    cache = PixelCache(image_processor, 1 << 30)
    cache([first], return_tensors="pt")  # no hash declared
    cache.declare({id(first): "a", id(second): "b"})
    both = cache([first, second], return_tensors="pt")["pixel_values"]
    cache([first, second], return_tensors="pt")
    assert cache.num_hits == 0 and not cache.entries and both.shape[0] == 2
    assert cache.crop_size == image_processor.crop_size  # the wrapped processor's settings


def test_capacity_bounds_the_cache(image_processor):
    first, second = images(2)
    size = image_processor([first], return_tensors="pt")["pixel_values"].numel() * 4
    cache = PixelCache(image_processor, size)
    cache.declare({id(first): "a", id(second): "b"})
    cache([first], return_tensors="pt")
    cache([second], return_tensors="pt")  # the first leaves
    cache([first], return_tensors="pt")
    assert cache.num_hits == 0 and cache.num_bytes == size and len(cache.entries) == 1
    off = PixelCache(image_processor, 0)
    off.declare({id(first): "a"})
    off([first], return_tensors="pt")
    off([first], return_tensors="pt")
    assert off.num_hits == 0 and not off.entries


@pytest.mark.parametrize("cache_gb", [1.0, pytest.param(0, marks=pytest.mark.slow)])
def test_recurring_images_match_transformers(tiny_llava_dir, llava_reference, cache_gb):
    llm = LLM(tiny_llava_dir, dtype="float32", max_num_seqs=4, mm_processor_cache_gb=cache_gb)
    first, second = images(2)
    cases = [("hi <image> what is this?", first), ("<image> Describe it.", first),
             ("hi <image> what is this?", second), ("<image> Describe it.", second), ("<image> again", first)]
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}} for text, image in cases],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for (text, image), output in zip(cases, outputs):
        assert list(output.outputs[0].token_ids) == llava_reference(text, [image], MAX_TOKENS), text
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    multimodal = engine.multimodal
    assert multimodal is not None
    assert multimodal.processor.image_processor.num_hits == (3 if cache_gb else 0)


@pytest.mark.parametrize("value", [-1, "1", True])
def test_a_bad_cache_size_is_refused(value):
    with pytest.raises(ConfigError, match="mm_processor_cache_gb"):
        EngineConfig(model="m", mm_processor_cache_gb=value)
