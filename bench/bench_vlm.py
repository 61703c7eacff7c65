"""Image captioning: shardline vs transformers' batched generate, side by side in one
process, on a small random LLaVA-shaped model (CLIP tower, projector, Llama text
model; float32, CPU by default).

The workload: ``--num-images`` distinct photos-sized images (640x480, 480x640 or
512x512, which the CLIP processor resizes and crops to the tower's input), each asked
twice, once for a caption and once for a list of its objects, the rows in a seeded
random order (a dataset's rows, not grouped by image); greedy, ``--output-len`` tokens
each. transformers' generate runs the rows in batches of ``--batch-size`` (processor
with left padding; 8, 16 and 32 measured alike on this model) and computes every row;
shardline reuses what an image's first row computed (the encoder output and the
prefix-cache blocks keyed by the image, the processed pixels). Printed: images/s and
their ratio for the captions alone (each image once) and for the whole workload, the
vision encoder's runs (which must equal the distinct images), and whether both sides
gave the same tokens.

``--cpu-time``: torch on one thread, each side timed by its process's CPU time (every
thread's: shardline preprocesses images on a small pool beside the engine), for a
machine other work is loading.

``--plain-processor``: also a third side, shardline with its processor step running the
model's processor on every prompt (no short path through the image processor, no
spliced expansions: engine/multimodal/fast_pixels.py, expansion.py), to see what those
save.

``--profile N``: instead, the captions of N images on each side under cProfile with
per-thread CPU time (torch on one thread): CPU ms per image of the whole process, of
the calling thread and of the others (shardline's image preprocessing pool), shardline's
split by stage (image encoder, text linears, attention, scheduler, the rest), and the
calling thread's functions with the most self time, to see where each side spends it.

    python bench/bench_vlm.py [--num-images 200] [--output-len 32] [--batch-size 16] [--repeat 1]
                              [--vision-size 336] [--patch-size 14] [--hidden-size 256] [--cpu-time]
                              [--plain-processor] [--profile N]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.engine.core.scheduler import Scheduler
from shardline.engine.cpu.capability import host_cpu
from shardline.engine.cpu.linear import packed_matmul
from shardline.engine.kernels.cpu_attention import decode_attention
from shardline.engine.kernels.cpu_prefill_attention import prefill_attention
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.tiny_vlm import build_tiny_llava
from shardline.engine.multimodal.encoder_cache import EncoderCache
from shardline.engine.multimodal.fast_pixels import FastPixels
from shardline.engine.multimodal.pixel_cache import PixelCache

CAPTION = "<|user|><image> Write a caption for this picture.<|end|><|assistant|>"
OBJECTS = "<|user|><image> List the objects you can see in this picture.<|end|><|assistant|>"
SIZES = ((640, 480), (480, 640), (512, 512))

Row = tuple[str, Image.Image]
Clock = Callable[[], float]


def make_images(count: int, seed: int = 0) -> list[Image.Image]:
    """``count`` random images of photo sizes."""
    generator = torch.Generator().manual_seed(seed)
    images = []
    for index in range(count):
        width, height = SIZES[index % len(SIZES)]
        pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
        images.append(Image.fromarray(pixels.numpy()))
    return images


def workload(images: list[Image.Image], seed: int = 0) -> list[Row]:
    """Each image twice (a caption, a list of objects), in a seeded random order."""
    rows = [(prompt, image) for image in images for prompt in (CAPTION, OBJECTS)]
    random.Random(seed).shuffle(rows)
    return rows


def run_hf(model_dir: str, rows: list[Row], output_len: int, batch_size: int,
           clock: Clock = time.perf_counter) -> tuple[float, list]:
    """Seconds for transformers' generate over batches of rows, and its tokens per row."""
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    model: Any = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = []
    start = clock()
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        inputs = processor(text=[prompt for prompt, _ in batch], images=[image for _, image in batch],
                           return_tensors="pt", padding=True)
        with torch.no_grad():
            # eos_token_id=-1: no stop, and the end token is not suppressed (shardline's ignore_eos).
            output = model.generate(**inputs, max_new_tokens=output_len, eos_token_id=-1, do_sample=False,
                                    pad_token_id=2)
        tokens += output[:, inputs["input_ids"].shape[1]:].tolist()
    return clock() - start, tokens


def fresh_engine(model_dir: str, plain_processor: bool = False) -> LLM:
    llm = LLM(model_dir, dtype="float32", max_num_seqs=64)
    if plain_processor:  # the model's processor on every prompt, as the engine's fallback runs it
        engine = llm.llm_engine
        assert isinstance(engine, LLMEngine) and engine.multimodal is not None, "a vision-language engine"
        engine.multimodal.expansions.splices = False
        cache = engine.multimodal.processor.image_processor
        assert isinstance(cache, PixelCache) and isinstance(cache.image_processor, FastPixels)
        cache.image_processor.enabled = False
    return llm


def run_shardline(llm: LLM, rows: list[Row], output_len: int,
                  clock: Clock = time.perf_counter) -> tuple[float, list, int]:
    """Seconds, tokens per row and the vision encoder's runs, on an engine that has seen
    none of the images."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine), "a generating engine"
    cache = engine.runner.encoder_cache
    assert cache is not None
    encoded_before = cache.num_encoded_images
    start = clock()
    outputs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}} for prompt, image in rows],
                           params, use_tqdm=False)
    elapsed = clock() - start
    return elapsed, [list(o.outputs[0].token_ids) for o in outputs], cache.num_encoded_images - encoded_before


def compare(label: str, model_dir: str, rows: list[Row], args: argparse.Namespace, clock: Clock) -> None:
    """The two sides over ``rows`` (best of ``--repeat`` rounds, each on a new engine)."""
    best_hf = best_sl = float("inf")
    hf_tokens: list = []
    sl_tokens: list = []
    encoded = 0
    for round_index in range(args.repeat):
        hf_s, hf_tokens = run_hf(model_dir, rows, args.output_len, args.batch_size, clock)
        llm = fresh_engine(model_dir)  # no image of an earlier round cached anywhere
        sl_s, sl_tokens, encoded = run_shardline(llm, rows, args.output_len, clock)
        del llm
        print(f"  round {round_index}: transformers {len(rows) / hf_s:.2f} rows/s ({hf_s:.1f} s), "
              f"shardline {len(rows) / sl_s:.2f} rows/s ({sl_s:.1f} s)", flush=True)
        best_hf, best_sl = min(best_hf, hf_s), min(best_sl, sl_s)
    if args.plain_processor:
        plain_s, plain_tokens, _ = run_shardline(fresh_engine(model_dir, plain_processor=True), rows,
                                                 args.output_len, clock)
        print(f"  shardline with the plain processor step: {len(rows) / plain_s:.2f} rows/s ({plain_s:.1f} s), "
              f"ratio to transformers {hf_s / plain_s:.2f}x (last round); tokens as shardline's: "
              f"{plain_tokens == sl_tokens}", flush=True)
    same = sum(a == b for a, b in zip(hf_tokens, sl_tokens))
    distinct = len({id(image) for _, image in rows})
    print(f"{label}: {len(rows)} rows of {distinct} images; transformers {len(rows) / best_hf:.2f} rows/s, "
          f"shardline {len(rows) / best_sl:.2f} rows/s, ratio {best_hf / best_sl:.2f}x; "
          f"{same}/{len(rows)} outputs token-identical; the vision encoder ran on {encoded} images", flush=True)


def profile(model_dir: str, images: list[Image.Image], args: argparse.Namespace) -> None:
    """Each side's captions of ``images`` under cProfile (see the module docstring)."""
    rows = [(CAPTION, image) for image in images]
    llm = fresh_engine(model_dir)
    run_shardline(llm, [(CAPTION, image) for image in make_images(4, seed=1)], args.output_len)  # warm
    sides: dict[str, Callable[[], object]] = {
        "transformers": lambda: run_hf(model_dir, rows, args.output_len, args.batch_size),
        "shardline": lambda: run_shardline(llm, rows, args.output_len)}
    for side, run in sides.items():
        profiler = cProfile.Profile(time.thread_time)
        process_start, thread_start = time.process_time(), time.thread_time()
        profiler.runcall(run)
        process_ms = (time.process_time() - process_start) * 1000 / len(rows)
        thread_ms = (time.thread_time() - thread_start) * 1000 / len(rows)
        print(f"{side}: {process_ms:.1f} CPU ms per image: calling thread {thread_ms:.1f}, other threads "
              f"{process_ms - thread_ms:.1f}; most self time (ms per image):", flush=True)
        stats: Any = pstats.Stats(profiler)
        if side == "shardline":
            print_stages(stats.stats, llm, len(rows), thread_ms, process_ms)
        entries = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:12]
        for (filename, line, name), (_, _, self_time, cumulative, _) in entries:
            where = f"{filename.rsplit('/', 2)[-1]}:{line}" if line else "built-in"
            print(f"  {self_time * 1000 / len(rows):7.2f}  (cumulative {cumulative * 1000 / len(rows):7.2f})  "
                  f"{name} [{where}]", flush=True)


def shardline_stages(llm: LLM) -> dict[str, Callable]:
    """The functions whose cumulative time makes up shardline's split, by stage: the
    image encoder (its vision tower and projector inside it), the embedding step around
    it, the text model (its attention kernels inside it), the scheduler; and, across
    both models, the packed linears (the engine packs the vision tower's too)."""
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine) and engine.runner.encoder_cache is not None, "a vision-language engine"
    model: Any = engine.runner.encoder_cache.model.model
    return {"image encoder": EncoderCache._encode,
            "  vision tower": type(model.vision_tower).forward,
            "  projector": type(model.multi_modal_projector).forward,
            "step embeddings": EncoderCache.step_embeddings,
            "text model": type(model.language_model).forward,
            "  prefill attention": prefill_attention,
            "  decode attention": decode_attention,
            "scheduler": Scheduler.schedule,
            "(packed linears, both models)": packed_matmul}


def print_stages(stats: dict, llm: LLM, count: int, thread_ms: float, process_ms: float) -> None:
    """CPU ms per image of each stage of shardline_stages (cumulative on the calling
    thread), the rest of that thread, and the other threads (image preparation)."""
    cumulative = {key: entry[3] for key, entry in stats.items()}
    totals = {}
    for stage, function in shardline_stages(llm).items():
        code = inspect.unwrap(function).__code__
        totals[stage] = cumulative.get((code.co_filename, code.co_firstlineno, code.co_name), 0.0) * 1000 / count
    totals["step embeddings"] -= totals["image encoder"]  # the scatter and the token embeddings alone
    disjoint = sum(value for stage, value in totals.items() if stage[0] not in " (")
    print("  split (CPU ms per image):", flush=True)
    for stage, value in totals.items():
        print(f"    {stage:<30} {value:7.2f}", flush=True)
    print(f"    {'rest of the calling thread':<30} {thread_ms - disjoint:7.2f}  (lm head, sampling, outputs, "
          f"Python per step)\n    {'other threads':<30} {process_ms - thread_ms:7.2f}  (image preparation)",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--num-images", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--vision-size", type=int, default=336, help="the vision tower's input size in pixels")
    parser.add_argument("--patch-size", type=int, default=14)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--cpu-time", action="store_true", help="one torch thread, timed by process CPU time")
    parser.add_argument("--plain-processor", action="store_true",
                        help="also run shardline with the model's processor on every prompt")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile the captions of N images")
    args = parser.parse_args()
    clock: Clock = time.perf_counter
    if args.cpu_time or args.profile:
        torch.set_num_threads(1)
        clock = time.process_time
    with tempfile.TemporaryDirectory() as folder:
        # By default a 336-pixel CLIP input in 14-pixel patches as LLaVA-1.5 (576 image tokens), at
        # small widths.
        model_dir = str(build_tiny_llava(folder, image_size=args.vision_size, patch_size=args.patch_size,
                                         hidden_size=args.hidden_size, num_text_layers=4))
        print(f"{(args.vision_size // args.patch_size) ** 2} image tokens per image, {args.output_len} output "
              f"tokens per row; host: {host_cpu()}; torch threads {torch.get_num_threads()}", flush=True)
        if args.profile:
            profile(model_dir, make_images(args.profile), args)
            return
        images = make_images(args.num_images)
        compare("captions (each image once)", model_dir, [(CAPTION, image) for image in images], args, clock)
        compare("each image twice (caption, objects)", model_dir, workload(images), args, clock)


if __name__ == "__main__":
    main()
