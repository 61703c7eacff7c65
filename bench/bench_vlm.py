"""Image captioning: shardline vs transformers' batched generate, side by side in one
process, on a small random LLaVA-shaped model (CLIP tower, projector, Llama text
model; float32, CPU by default).

Each image gets the same captioning prompt; greedy, fixed output length. Prints
images/s for transformers' generate over batches (processor with left padding) and
for shardline, with their ratio; then shardline over the same images each appearing
twice, with the vision encoder's runs (which must equal the distinct images).

``--cpu-time``: torch on one thread, each side timed by its process's CPU time (every
thread's: shardline preprocesses images on a small pool beside the engine), for a
machine other work is loading.

    python bench/bench_vlm.py [--num-images 256] [--output-len 16] [--batch-size 32] [--repeat 1]
                              [--vision-size 336] [--patch-size 14] [--hidden-size 256] [--cpu-time]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.engine.cpu.capability import host_cpu
from shardline.engine.model.tiny_vlm import build_tiny_llava

PROMPT = "<|user|><image> Write a caption for this picture.<|end|><|assistant|>"


def make_images(count: int, size: int, seed: int = 0) -> list[Image.Image]:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (count, size, size, 3), generator=generator, dtype=torch.uint8).numpy()
    return [Image.fromarray(array) for array in pixels]


Clock = Callable[[], float]


def run_hf(model_dir: str, pictures: list[Image.Image], output_len: int, batch_size: int,
           clock: Clock = time.perf_counter) -> tuple[float, list]:
    """Seconds for transformers' generate over batches, and its tokens per image."""
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    model: Any = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = []
    start = clock()
    for i in range(0, len(pictures), batch_size):
        batch = pictures[i : i + batch_size]
        inputs = processor(text=[PROMPT] * len(batch), images=batch, return_tensors="pt", padding=True)
        with torch.no_grad():
            # eos_token_id=-1: no stop, and the end token is not suppressed (shardline's ignore_eos).
            output = model.generate(**inputs, max_new_tokens=output_len, eos_token_id=-1, do_sample=False,
                                    pad_token_id=2)
        tokens += output[:, inputs["input_ids"].shape[1]:].tolist()
    return clock() - start, tokens


def run_shardline(llm: LLM, pictures: list[Image.Image], output_len: int,
                  clock: Clock = time.perf_counter) -> tuple[float, list]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.reset_prefix_cache()
    cache = llm.llm_engine.runner.encoder_cache
    assert cache is not None
    cache.clear()
    start = clock()
    outputs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in pictures], params,
                           use_tqdm=False)
    elapsed = clock() - start
    return elapsed, [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--num-images", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--vision-size", type=int, default=336, help="the vision tower's input size in pixels")
    parser.add_argument("--patch-size", type=int, default=14)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--cpu-time", action="store_true", help="one torch thread, timed by process CPU time")
    args = parser.parse_args()
    clock: Clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.process_time
    with tempfile.TemporaryDirectory() as folder:
        # By default a 336-pixel CLIP input in 14-pixel patches as LLaVA-1.5 (576 image tokens), at
        # small widths.
        model_dir = str(build_tiny_llava(folder, image_size=args.vision_size, patch_size=args.patch_size,
                                         hidden_size=args.hidden_size, num_text_layers=4))
        print(f"{(args.vision_size // args.patch_size) ** 2} image tokens per image, {args.output_len} output tokens")
        pictures = make_images(args.num_images, args.image_size)
        llm = LLM(model_dir, dtype="float32", max_num_seqs=64)
        print(f"host: {host_cpu()}; torch threads {torch.get_num_threads()}; CPU paths {llm.llm_engine.cpu_paths}")
        best_hf, best_sl, hf_tokens, sl_tokens = float("inf"), float("inf"), [], []
        for round_index in range(args.repeat):
            hf_s, hf_tokens = run_hf(model_dir, pictures, args.output_len, args.batch_size, clock)
            sl_s, sl_tokens = run_shardline(llm, pictures, args.output_len, clock)
            print(f"round {round_index}: transformers {len(pictures) / hf_s:.2f} images/s ({hf_s:.1f} s), "
                  f"shardline {len(pictures) / sl_s:.2f} images/s ({sl_s:.1f} s)")
            best_hf, best_sl = min(best_hf, hf_s), min(best_sl, sl_s)
        same = sum(a == b for a, b in zip(hf_tokens, sl_tokens))
        print(f"best: transformers {len(pictures) / best_hf:.2f} images/s, shardline {len(pictures) / best_sl:.2f} "
              f"images/s, ratio {best_hf / best_sl:.2f}x; {same}/{len(pictures)} captions token-identical")
        doubled = pictures + pictures
        cache = llm.llm_engine.runner.encoder_cache
        assert cache is not None
        encoded_before = cache.num_encoded_images
        twice_s, _ = run_shardline(llm, doubled, args.output_len, clock)
        print(f"each image twice: {len(doubled) / twice_s:.2f} images/s; the vision encoder ran on "
              f"{cache.num_encoded_images - encoded_before} images for {len(pictures)} distinct "
              f"({len(doubled)} prompts)")


if __name__ == "__main__":
    main()
