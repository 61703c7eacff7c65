"""LLaVA-NeXT ("anyres" tiling: each image its own number of placeholder tokens) token
for token against transformers' generate, images of several aspect ratios, one and
two per prompt, prefill chunked across the images."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny_vlm import build_tiny_llava_next

from .conftest import images

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_llava_next(tmp_path_factory.mktemp("tiny-llava-next")))


def test_anyres_images_match_transformers(model_dir):
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    wide, tall, square = images(1, (60, 20)) + images(1, (20, 60)) + images(1, (32, 32))
    cases = [("hi <image> what?", [wide]), ("hi <image> what?", [tall]), ("<image> then <image>", [square, wide])]
    expected = []
    for text, pictures in cases:
        inputs = processor(text=text, images=pictures, return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        expected.append(output[0, inputs["input_ids"].shape[1]:].tolist())
    assert expected[0] != expected[1]
    for budget in (2048, 7):  # whole prompts, then chunks that split every image
        llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
        outputs = llm.generate([{"prompt": t, "multi_modal_data": {"image": p}} for t, p in cases],
                               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected, budget
        lengths = {len(o.prompt_token_ids) for o in outputs[:2]}
        assert len(lengths) == 2 or outputs[0].prompt_token_ids != outputs[1].prompt_token_ids
