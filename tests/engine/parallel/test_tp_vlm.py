"""A vision-language model over tensor-parallel ranks: a tiny LLaVA with its language
model split and its vision tower whole on every rank (run on rank 0, the step's input
embeddings sent to the other rank) gives transformers' greedy tokens with images on 2
gloo ranks, as on 1; so does Qwen3-VL, whose deepstack rows rank 0 sends too."""

from __future__ import annotations

import torch
import transformers
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny_qwen_vl import build_tiny_qwen_vl
from shardline.engine.model.tiny_vlm import build_tiny_llava
from shardline.engine.multimodal.image_only import load_processor
from shardline.engine.multimodal.qwen_vl import num_deepstack_layers
from shardline.engine.parallel.layers import GatheredLMHead, RowParallelLinear
from shardline.engine.parallel.vlm import encoder_prefixes

MAX_TOKENS = 8
CASES = [("hi <image> what is this?", 0), ("<image> Describe it.", 1), ("hi <image> what is this?", 2)]


def pictures(count: int) -> list[Image.Image]:
    generator = torch.Generator().manual_seed(7)
    return [Image.fromarray(torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8).numpy())
            for _ in range(count)]


def reference(model_dir: str, cases: list[tuple[str, Image.Image]]) -> list[list[int]]:
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = []
    for text, image in cases:
        inputs = processor(text=text, images=[image], return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=MAX_TOKENS,  # pyright: ignore[reportAttributeAccessIssue]
                                    do_sample=False)
        tokens.append(output[0, inputs["input_ids"].shape[1]:].tolist())
    return tokens


def generate(llm: LLM, cases: list[tuple[str, Image.Image]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}} for text, image in cases],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_llava_on_two_ranks_matches_transformers(tmp_path):
    model_dir = str(build_tiny_llava(tmp_path / "llava"))
    images = pictures(3)
    cases = [(text, images[index]) for text, index in CASES]
    expected = reference(model_dir, cases)
    assert expected[0] != expected[2]  # the image changes the tokens
    options = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)  # an image's rows over two steps
    two_ranks = LLM(model_dir, tensor_parallel_size=2, **options)
    try:
        assert generate(two_ranks, cases) == expected
        model = two_ranks.llm_engine.model  # pyright: ignore[reportAttributeAccessIssue]
        encoders = encoder_prefixes(model)
        assert "model.vision_tower." in encoders and "model.multi_modal_projector." in encoders
        split = {name for name, module in model.named_modules() if isinstance(module, RowParallelLinear)}
        assert split and not any(name.startswith(encoders) for name in split)  # the encoders stay whole
        assert isinstance(model.get_output_embeddings(), GatheredLMHead)
        assert type(model.get_input_embeddings()) is torch.nn.Embedding  # whole: rank 0 scatters the images in
    finally:
        two_ranks.close()


def test_deepstack_rows_reach_every_rank(tmp_path):
    """Qwen3-VL adds image rows to its early layers' hidden states (deepstack): rank 0
    sends them with the step, and 2 ranks give transformers' tokens, an image's rows
    over several steps (5 tokens a step)."""
    model_dir = str(build_tiny_qwen_vl(tmp_path / "qwen3_vl", "qwen3_vl"))
    assert num_deepstack_layers(transformers.AutoConfig.from_pretrained(model_dir))
    processor = load_processor(model_dir, "qwen3_vl")
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    cases = [(f"hi {image} what is this?", picture) for picture in pictures(2)] + [(f"{image}Describe it.",
                                                                                    pictures(1)[0])]
    expected = []
    for text, picture in cases:
        inputs = processor(text=[text], images=[picture], return_tensors="pt")  # pyright: ignore[reportOptionalCall]
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=MAX_TOKENS,  # pyright: ignore[reportAttributeAccessIssue]
                                    do_sample=False)
        expected.append(output[0, inputs["input_ids"].shape[1]:].tolist())
    assert expected[0] != expected[1]  # the image changes the tokens
    two_ranks = LLM(model_dir, tensor_parallel_size=2, dtype="float32", max_num_seqs=4, max_num_batched_tokens=5)
    try:
        assert generate(two_ranks, cases) == expected
    finally:
        two_ranks.close()
