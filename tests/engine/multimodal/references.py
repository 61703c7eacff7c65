"""What the image-model tests share: transformers' greedy generate as the reference, and
the check that the engine gives its tokens for a list of prompts with images."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from PIL import Image

from shardline import LLM, SamplingParams

Reference = Callable[[str, list[Image.Image]], list[int]]


def greedy_reference(model_dir: str, processor: Any, max_tokens: int) -> Callable[..., list[int]]:
    """Greedy tokens of transformers' own generate (float32), one prompt at a time,
    with ``processor`` preparing its inputs (``causal``: without the token types that
    make Gemma 3's image rows attend both ways)."""
    model: Any = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(text: str, pictures: list[Image.Image], causal: bool = False) -> list[int]:
        inputs = processor(text=text, images=pictures, return_tensors="pt")
        if causal:
            inputs.pop("token_type_ids")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        return output[0, inputs["input_ids"].shape[1]:].tolist()

    return generate


def check_cases(llm: LLM, reference: Reference, params: SamplingParams, pictures: list[Image.Image],
                cases: list[tuple[str, list[int]]]) -> None:
    """Each (text, indices of ``pictures``) case gives the reference's tokens, all in one call."""
    prompts = [(text, [pictures[i] for i in indices]) for text, indices in cases]
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": pics}} for text, pics in prompts], params,
                           use_tqdm=False)
    for (text, pics), output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == reference(text, pics), text
