"""Image rows end to end on a tiny LLaVA: the pipeline's tokens equal LLM.generate's with the
same images, the image changes them, and usage counts the image's tokens as prompt tokens."""

from __future__ import annotations

import io

import pyarrow.parquet as pq
import pytest
from PIL import Image

from shardline import LLM, SamplingParams
from shardline.tasks.image_feed import ImageFeed
from shardline.tasks.job import BatchJob
from shardline.tasks.manifest import ShardManifest
from shardline.tasks.media import ImageOptions
from shardline.tasks.runner import ShardRunner
from shardline.tasks.sample_data import write_rows
from shardline.tasks.shard_job import process_shard, read_shard
from shardline.tasks.storage import list_shards

from .test_media import data_url, png_bytes

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> str:
    from shardline.engine.model.tiny_vlm import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava")))


@pytest.fixture(scope="module")
def llava_llm(tiny_llava: str):
    llm = LLM(tiny_llava, max_num_seqs=8)
    yield llm
    llm.close()


def image_rows() -> tuple[list[dict], list[bytes]]:
    images = [png_bytes(seed, size=(40, 28)) for seed in (11, 12, 13)]
    rows = [{"id": f"r{n}", "prompt": f"<image> Describe {n % 2}", "image": images[n % 3]} for n in range(6)]
    rows.insert(2, {"id": "text", "prompt": "No image at all", "image": None})
    return rows, images


def reference(llm: LLM, rows: list[dict]) -> list:
    prompts = [row["prompt"] if row["image"] is None else {"prompt": row["prompt"], "multi_modal_data": {
        "image": Image.open(io.BytesIO(row["image"])).convert("RGB")}} for row in rows]
    return llm.generate(prompts, GREEDY, use_tqdm=False)


def test_pipeline_tokens_equal_llm_generate_with_the_same_images(llava_llm, tiny_llava, tmp_path):
    rows, _ = image_rows()
    write_rows(str(tmp_path / "in" / "part-0.parquet"), rows)
    budget = 2 * 40 * 28 * 3  # two decoded images: the rows go through in several windows
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=tiny_llava,
                   sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0},
                   images={"column": "image", "prefetch_bytes": budget})
    prepared = read_shard(list_shards(job.input)[0], job)
    requests = [row.request for row in prepared.rows if row.request is not None]
    runner = ShardRunner(llava_llm)
    try:
        feed = ImageFeed(runner, job.images, {})
        results = feed.run_shard("part-0", requests)
    finally:
        runner.close()
    expected = reference(llava_llm, rows)
    assert [result.error for result in results] == [None] * len(rows)
    assert [list(r.output.outputs[0].token_ids) for r in results] == [list(e.outputs[0].token_ids) for e in expected]
    assert [list(r.output.prompt_token_ids) for r in results] == [list(e.prompt_token_ids) for e in expected]
    # the image decides the tokens: r0 and r2 share their text (Describe 0), not their image
    assert rows[0]["prompt"] == rows[3]["prompt"] and rows[0]["image"] != rows[3]["image"]
    assert list(expected[0].outputs[0].token_ids) != list(expected[3].outputs[0].token_ids)
    assert 0 < feed.peak_bytes <= budget


def test_usage_counts_image_tokens_as_prompt_tokens(llava_llm, tiny_llava, tmp_path):
    rows, _ = image_rows()
    write_rows(str(tmp_path / "in" / "part-0.parquet"), rows)
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=tiny_llava,
                   sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0}, images={"column": "image"})
    manifest: ShardManifest = process_shard(list_shards(job.input)[0], job)
    out = pq.read_table(tmp_path / "out" / "part-0.parquet").to_pylist()
    expected = reference(llava_llm, rows)
    assert [row["text"] for row in out] == [e.outputs[0].text for e in expected]
    assert [row["prompt_tokens"] for row in out] == [len(e.prompt_token_ids) for e in expected]
    text_only = len(llava_llm.get_tokenizer()("<image> Describe 0")["input_ids"])
    assert out[0]["prompt_tokens"] > text_only  # the image's placeholders are counted
    assert manifest.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected) and manifest.errors == 0


def test_preflight_refuses_an_image_column_for_a_model_that_takes_no_images(tiny_model, tiny_llava, tmp_path):
    from shardline.tasks.errors import ModelUnusable
    from shardline.tasks.preflight import check_model

    def job(model: str) -> BatchJob:
        return BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=model,
                        images={"column": "picture"})

    with pytest.raises(ModelUnusable, match=r"images.column='picture' gives rows images, but shardline runs no "
                                            r"images of model type 'llama' \(vision-language types it runs: .*llava"):
        check_model(job(tiny_model))
    assert check_model(job(tiny_llava)) == "LlavaForConditionalGeneration"
    assert check_model(job(tiny_model).model_copy(update={"images": ImageOptions()}))  # no image column: text runs


def test_chat_rows_with_image_parts_equal_llm_chat(llava_llm, tiny_llava, tmp_path):
    images = [png_bytes(seed, size=(30, 36)) for seed in (21, 22)]

    def chat(image: bytes | None, text: str) -> list[dict]:
        parts: list[dict] = [{"type": "text", "text": text}]
        if image is not None:
            parts.insert(0, {"type": "image_url", "image_url": {"url": data_url(image)}})
        return [{"role": "user", "content": parts}]

    rows = [{"id": "a", "messages": chat(images[0], "What is it?")}, {"id": "t", "messages": chat(None, "Hi")},
            {"id": "b", "messages": chat(images[1], "What is it?")}]
    write_rows(str(tmp_path / "in" / "part-0.jsonl"), rows)
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=tiny_llava, task="chat",
                   sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0})
    prepared = read_shard(list_shards(job.input)[0], job)
    runner = ShardRunner(llava_llm)
    try:
        results = ImageFeed(runner, job.images, {}).run_shard(
            "part-0", [row.request for row in prepared.rows if row.request is not None])
    finally:
        runner.close()
    as_pil = [[{**message, "content": [
        {"type": "image_pil", "image_pil": Image.open(io.BytesIO(image)).convert("RGB")}
        if part["type"] == "image_url" else part for part in message["content"]]} for message in row["messages"]]
        for row, image in zip(rows, [images[0], None, images[1]], strict=True)]
    expected = llava_llm.chat(as_pil, GREEDY, use_tqdm=False)
    assert [result.error for result in results] == [None, None, None]
    assert [list(r.output.outputs[0].token_ids) for r in results] == [list(e.outputs[0].token_ids) for e in expected]
    assert [list(r.output.prompt_token_ids) for r in results] == [list(e.prompt_token_ids) for e in expected]
    assert list(expected[0].outputs[0].token_ids) != list(expected[2].outputs[0].token_ids)  # the image decides


def test_openai_batch_lines_with_images_answer_as_llm_chat(llava_llm, tiny_llava, tmp_path):
    import json

    image = png_bytes(31, size=(33, 29))
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "Caption"}]
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": tiny_llava, "messages": [{"role": "user", "content": content}],
                     "max_tokens": MAX_TOKENS, "temperature": 0}}
    write_rows(str(tmp_path / "in" / "part-0.jsonl"), [line])
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=tiny_llava, output_format="openai")
    process_shard(list_shards(job.input)[0], job)
    [answer] = [json.loads(text) for text in (tmp_path / "out" / "part-0.jsonl").read_text().splitlines()]
    pil = Image.open(io.BytesIO(image)).convert("RGB")
    [expected] = llava_llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": pil}, content[1]]}],
                                GREEDY, use_tqdm=False)
    body = answer["response"]["body"]
    assert answer["error"] is None and body["choices"][0]["message"]["content"] == expected.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)  # image tokens are prompt tokens


def test_an_image_column_in_a_chat_job_goes_before_the_first_user_text(llava_llm, tiny_llava, tmp_path):
    image = png_bytes(41, size=(26, 30))
    rows = [{"id": "a", "messages": json_messages("Who?"), "image": image},
            {"id": "b", "messages": json_messages("Who?"), "image": None}]
    write_rows(str(tmp_path / "in" / "part-0.parquet"), rows)
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=tiny_llava, task="chat",
                   sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0}, images={"column": "image"})
    process_shard(list_shards(job.input)[0], job)
    out = pq.read_table(tmp_path / "out" / "part-0.parquet").to_pylist()
    pil = Image.open(io.BytesIO(image)).convert("RGB")
    expected = llava_llm.chat([
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "image_pil", "image_pil": pil}, {"type": "text", "text": "Who?"}]}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"}]], GREEDY, use_tqdm=False)
    assert [row["error"] for row in out] == [None, None]
    assert [row["text"] for row in out] == [e.outputs[0].text for e in expected]
    assert [row["prompt_tokens"] for row in out] == [len(e.prompt_token_ids) for e in expected]


def json_messages(text: str) -> str:
    """A chat as a JSON string (a Parquet column of text)."""
    import json

    return json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}])


def test_a_prompt_without_the_images_placeholder_is_an_error_row(tiny_llava, tmp_path):
    rows = [{"id": "no-placeholder", "prompt": "Describe", "image": png_bytes(51)},
            {"id": "ok", "prompt": "<image> Describe", "image": png_bytes(52)}]
    write_rows(str(tmp_path / "in" / "part-0.parquet"), rows)
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=tiny_llava,
                   sampling={"max_tokens": 2, "temperature": 0.0}, images={"column": "image"})
    process_shard(list_shards(job.input)[0], job)
    out = pq.read_table(tmp_path / "out" / "part-0.parquet").to_pylist()
    assert "Found total 0 <image> tokens and 1 images" in out[0]["error"] and out[1]["error"] is None


def test_a_row_with_a_list_of_images(llava_llm, tiny_llava, tmp_path):
    images = [png_bytes(61, size=(20, 24)), png_bytes(62, size=(36, 20))]
    rows = [{"id": "two", "prompt": "<image><image> Compare", "image": images},
            {"id": "swapped", "prompt": "<image><image> Compare", "image": images[::-1]}]
    write_rows(str(tmp_path / "in" / "part-0.parquet"), rows)
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=tiny_llava,
                   sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0}, images={"column": "image"})
    process_shard(list_shards(job.input)[0], job)
    out = pq.read_table(tmp_path / "out" / "part-0.parquet").to_pylist()
    expected = llava_llm.generate([{"prompt": row["prompt"], "multi_modal_data": {"image": [
        Image.open(io.BytesIO(data)).convert("RGB") for data in row["image"]]}} for row in rows], GREEDY,
        use_tqdm=False)
    assert [row["error"] for row in out] == [None, None]
    assert [row["text"] for row in out] == [e.outputs[0].text for e in expected]
    assert expected[0].outputs[0].token_ids != expected[1].outputs[0].token_ids  # the images' order counts
