"""Gemma 3's image rows (attending both ways within an image) through the CPU prefill
kernel in the engine: greedy tokens equal transformers', and the kernel took the
steps' key limits (the kernel against its reference: test_cpu_prefill_attention.py)."""

from __future__ import annotations

import torch
import transformers
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.engine.kernels import cpu_prefill_attention
from shardline.engine.model.tiny_vlm_gemma3 import build_tiny_gemma3

from ..cpu.paths_taken import taken_unless_forced_off
from ..multimodal.references import greedy_reference

MAX_TOKENS = 6
PROMPTS = ["hi <start_of_image> x", "<start_of_image> and <start_of_image> compare them"]


def noise_images(count: int, seed: int) -> list[Image.Image]:
    generator = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (30, 40, 3), generator=generator, dtype=torch.uint8).numpy())
            for _ in range(count)]


@taken_unless_forced_off("prefill_kernel")
def test_image_rows_attend_both_ways_through_the_kernel(tmp_path, monkeypatch):
    model_dir = str(build_tiny_gemma3(tmp_path / "gemma3"))
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "prefill_kernel=on")
    limits_seen = []
    real = cpu_prefill_attention.prefill_attention

    def spy(*args, key_limits=None, **kwargs):  # the real kernel, with its key limits noted
        limits_seen.append(key_limits is not None)
        return real(*args, key_limits=key_limits, **kwargs)

    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention", spy)
    # Images whose two-way rows change transformers' tokens (checked below), so a kernel
    # that ignored the limits would fail.
    cases = [(PROMPTS[0], noise_images(1, 1)), (PROMPTS[1], noise_images(2, 2))]
    llm = LLM(model_dir, dtype="float32", max_num_seqs=4)
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": pictures}} for text, pictures in cases],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert any(limits_seen), "no image step reached the prefill kernel"
    reference = greedy_reference(model_dir, transformers.AutoProcessor.from_pretrained(model_dir), MAX_TOKENS)
    for (text, pictures), output in zip(cases, outputs):
        expected = reference(text, pictures)
        assert list(output.outputs[0].token_ids) == expected, text
        assert expected != reference(text, pictures, causal=True), text
