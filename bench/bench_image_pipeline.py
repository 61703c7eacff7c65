"""Images through the shard pipeline against the engine alone, side by side in one process,
on a small random LLaVA-shaped model (float32, CPU).

Engine alone: ``LLM.generate`` over every row's prompt with its image already decoded
(PIL), the engine's own preprocessing pool ahead of it. Pipeline: the same rows as one
Parquet shard whose image column holds PNG bytes, through ``process_shard`` (read, the
image feed's reading and decoding ahead of the engine, the prompts prepared off the
driver thread, the engine, the write), on this process's engine (the default host).
Each is run once untimed first (first-use costs count in neither), then interleaved
``--repeat`` times; the best of each is compared. Greedy, fixed output length.

    python bench/bench_image_pipeline.py [--rows 128] [--output-len 8] [--image-size 96] [--repeat 2]
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.engine.cpu.capability import host_cpu
from shardline.engine.model.tiny_vlm import build_tiny_llava
from shardline.tasks.engine_cache import close_engines
from shardline.tasks.job import BatchJob, SamplingDefaults
from shardline.tasks.media import ImageOptions
from shardline.tasks.sample_data import write_rows
from shardline.tasks.shard_job import process_shard
from shardline.tasks.storage import list_shards

PROMPT = "<|user|><image> Write a caption for this picture.<|end|><|assistant|>"
ENGINE_OPTIONS = {"max_num_seqs": 64}


def png_images(count: int, size: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    images = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    return images


def engine_alone(llm: LLM, images: list[bytes], output_len: int) -> tuple[float, list[str]]:
    decoded = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": image}} for image in decoded]
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - started, [output.outputs[0].text for output in outputs]


def pipeline(model: str, root: Path, run: int, output_len: int) -> tuple[float, list[str]]:
    import pyarrow.parquet as pq

    job = BatchJob(input=str(root / "in"), output=str(root / f"out-{run}"), model=model,
                   sampling=SamplingDefaults(max_tokens=output_len, temperature=0.0), engine_options=ENGINE_OPTIONS,
                   images=ImageOptions(column="image"))
    [shard] = list_shards(job.input)
    started = time.perf_counter()
    process_shard(shard, job)
    seconds = time.perf_counter() - started
    return seconds, pq.read_table(root / f"out-{run}" / "part-0.parquet").column("text").to_pylist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=96, help="pixels a side (the processor resizes)")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-image-pipeline-"))
    model = str(build_tiny_llava(root / "llava"))
    images = png_images(args.rows, args.image_size)
    write_rows(str(root / "in" / "part-0.parquet"), [{"id": str(n), "prompt": PROMPT, "image": data}
                                                    for n, data in enumerate(images)])
    print(f"host: {host_cpu()}; {args.rows} rows, {args.image_size}px PNG, {args.output_len} tokens each")
    llm = LLM(model, **ENGINE_OPTIONS)
    try:
        _, reference = engine_alone(llm, images, args.output_len)  # warm-up
        _, texts = pipeline(model, root, 0, args.output_len)
        assert texts == reference, "the pipeline's texts differ from LLM.generate's"
        alone, piped = [], []
        for run in range(1, args.repeat + 1):
            alone.append(engine_alone(llm, images, args.output_len)[0])
            piped.append(pipeline(model, root, run, args.output_len)[0])
    finally:
        llm.close()
        close_engines()
    best_alone, best_piped = min(alone), min(piped)
    print(f"engine alone (LLM.generate, decoded images): {args.rows / best_alone:8.1f} images/s "
          f"(best of {args.repeat}: {best_alone:.2f}s)")
    print(f"pipeline (Parquet PNG bytes -> output shard): {args.rows / best_piped:8.1f} images/s "
          f"(best of {args.repeat}: {best_piped:.2f}s)")
    print(f"pipeline / engine alone, images/s: {best_alone / best_piped:.2f}")


if __name__ == "__main__":
    main()
