"""Image rows end to end on a tiny Qwen2-VL and Qwen3-VL (M-RoPE; Qwen3-VL's deepstack): a
shard of prompt rows with an image column and chat rows with image_url parts gives, row for
row, the text of transformers' greedy generate with the same images."""

from __future__ import annotations

import io

import pyarrow.parquet as pq
import pytest
import torch
import transformers
from PIL import Image

from shardline.engine.model.tiny_qwen_vl import build_tiny_qwen_vl
from shardline.engine.multimodal.image_only import load_processor
from shardline.tasks.job import BatchJob
from shardline.tasks.sample_data import write_rows
from shardline.tasks.shard_job import process_shard
from shardline.tasks.storage import list_shards

from .test_media import data_url, png_bytes

MAX_TOKENS = 6
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_image_rows_give_transformers_text(model_type, tmp_path):
    model_dir = str(build_tiny_qwen_vl(tmp_path / "model", model_type))
    images = [png_bytes(seed, size=size) for seed, size in ((71, (40, 30)), (72, (16, 24)), (73, (32, 32)))]
    prompt_rows = [{"id": f"p{n}", "prompt": f"{IMAGE} Describe {n}", "image": images[n]} for n in range(3)]
    write_rows(str(tmp_path / "prompts" / "part-0.parquet"), prompt_rows)
    chat_rows = [{"id": f"c{n}", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(images[n])}}, {"type": "text", "text": "Caption"}]}]}
        for n in range(3)]
    write_rows(str(tmp_path / "chats" / "part-0.jsonl"), chat_rows)
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    for name, extra in (("prompts", {"images": {"column": "image"}}), ("chats", {"task": "chat"})):
        job = BatchJob(input=str(tmp_path / name), output=str(tmp_path / f"out-{name}"), model=model_dir,
                       sampling=sampling, **extra)
        process_shard(list_shards(job.input)[0], job)

    processor = load_processor(model_dir, model_type)
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()

    def reference(text: str, image: bytes) -> str:
        inputs = processor(text=[text], images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        return processor.tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    chat_text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Caption"}]}], tokenize=False,
        add_generation_prompt=True)
    prompts_out = pq.read_table(tmp_path / "out-prompts" / "part-0.parquet").to_pylist()
    chats_out = pq.read_table(tmp_path / "out-chats" / "part-0.parquet").to_pylist()
    assert [row["error"] for row in prompts_out + chats_out] == [None] * 6
    assert [row["text"] for row in prompts_out] == [reference(row["prompt"], row["image"]) for row in prompt_rows]
    assert [row["text"] for row in chats_out] == [reference(chat_text, image) for image in images]
    assert len({row["text"] for row in chats_out}) > 1  # the image decides the text
