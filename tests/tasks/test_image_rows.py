"""Rows with images through the shard pipeline: an image column (bytes or URLs), image parts in
chats and in OpenAI Batch lines; unreadable images become error rows, order kept, the job goes on."""

from __future__ import annotations

import http.server
import io
import json
import re
import threading

import pyarrow.parquet as pq
import pytest

from shardline.tasks.executor import RunnerError, ShardAborted
from shardline.tasks.image_feed import ImageFeed
from shardline.tasks.job import BatchJob
from shardline.tasks.media import ImageOptions
from shardline.tasks.runner import ShardRunner
from shardline.tasks.sample_data import write_rows
from shardline.tasks.shard_job import process_shard, read_shard
from shardline.tasks.shard_reader import ShardError
from shardline.tasks.storage import filesystem, list_shards

from .test_engine_client import service  # noqa: F401 (the engine service fixture)
from .test_media import data_url, png_bytes

TEXT_MODEL_REFUSAL = r"carries 1 image item\(s\).*cannot take image input"


def run_job(job: BatchJob) -> list[dict]:
    [shard] = list_shards(job.input, job.storage())
    process_shard(shard, job)
    fs, path = filesystem(job.output, job.storage())
    return pq.read_table(io.BytesIO(fs.cat_file(f"{path}/{shard.key}.parquet"))).to_pylist()


def test_image_column_rows_on_a_text_model(make_job, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_STORAGE_RETRY_SECONDS", "0")
    good = png_bytes(1)
    (tmp_path / "cat.png").write_bytes(good)
    rows = [
        {"id": "data", "prompt": "<image> what is it?", "image": data_url(good)},
        {"id": "none", "prompt": "no image here", "image": None},
        {"id": "broken", "prompt": "<image>", "image": data_url(b"\x89PNG but not really")},
        {"id": "file", "prompt": "<image>", "image": f"file://{tmp_path}/cat.png"},
        {"id": "missing", "prompt": "<image>", "image": f"file://{tmp_path}/dog.png"},
        {"id": "web", "prompt": "<image>", "image": "https://example.com/cat.png"},
        {"id": "unreachable", "prompt": "<image>", "image": "http://127.0.0.1:9/cat.png"},
        {"id": "big", "prompt": "<image>", "image": data_url(png_bytes(2, size=(64, 64)))},
    ]
    write_rows(str(tmp_path / "in" / "part-0.jsonl"), rows)
    job = make_job(images={"column": "image", "allowed_domains": ["127.0.0.1"], "max_image_bytes": 4000})
    out = run_job(job)
    assert [row["id"] for row in out] == [row["id"] for row in rows]
    errors = {row["id"]: row["error"] for row in out}
    assert errors["none"] is None and out[1]["text"]
    for name in ("data", "file"):  # read and decoded; the text model refuses them (never run without)
        assert errors[name] is not None and re.search(TEXT_MODEL_REFUSAL, errors[name])
    assert errors["broken"].startswith("row 2: image 1 (data:image/png;base64,... (50 characters)) is not an image")
    assert errors["missing"].startswith(f"row 4: file://{tmp_path}/dog.png could not be read (FileNotFoundError")
    assert "host 'example.com' is not in images.allowed_domains" in errors["web"]
    assert errors["unreachable"].startswith("row 6: http://127.0.0.1:9/cat.png could not be read")
    assert "over images.max_image_bytes=4000" in errors["big"]
    assert all(row["prompt_tokens"] is None for row in out if row["error"] is not None)


def test_parquet_image_bytes_column(make_job, tmp_path):
    rows = [{"id": "good", "prompt": "<image>", "image": png_bytes(7)},
            {"id": "none", "prompt": "plain", "image": None},
            {"id": "broken", "prompt": "<image>", "image": b"\x89PNG but not really"}]
    write_rows(str(tmp_path / "in" / "part-0.parquet"), rows)
    out = run_job(make_job(images={"column": "image"}))
    assert [row["id"] for row in out] == ["good", "none", "broken"]
    assert "cannot take image input" in out[0]["error"] and out[1]["error"] is None
    assert out[2]["error"].startswith("row 2: image 1 (image bytes (19 bytes)) is not an image PIL can read")


def test_parquet_image_column_of_hugging_face_structs(make_job, tmp_path):
    good = png_bytes(3)
    rows = [{"id": "a", "prompt": "<image>", "picture": {"bytes": good, "path": "a.png"}},
            {"id": "b", "prompt": "plain", "picture": {"bytes": None, "path": None}}]
    write_rows(str(tmp_path / "in" / "part-0.parquet"), rows)
    out = run_job(make_job(images={"column": "picture"}))
    assert out[0]["error"] is not None and "cannot take image input" in out[0]["error"]
    assert out[1]["error"] is None


def test_a_shard_without_the_image_column_fails_whole(make_job, tmp_path):
    write_rows(str(tmp_path / "in" / "part-0.jsonl"), [{"prompt": "hi"}])
    job = make_job(images={"column": "image"})
    [shard] = list_shards(job.input)
    with pytest.raises(ShardError, match="no 'image' column, which images.column names"):
        read_shard(shard, job)


def test_chat_rows_with_image_url_parts(make_job, tmp_path):
    image_part = {"type": "image_url", "image_url": {"url": data_url(png_bytes(4))}}
    rows = [
        {"id": "image", "messages": [{"role": "user", "content": [{"type": "text", "text": "What?"}, image_part]}]},
        {"id": "text", "messages": [{"role": "user", "content": "Hello"}]},
        {"id": "bad-part", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"id": "bad-url", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}]},
    ]
    write_rows(str(tmp_path / "in" / "part-0.jsonl"), rows)
    out = run_job(make_job(task="chat"))
    errors = {row["id"]: row["error"] for row in out}
    assert "image input" in errors["image"] and "refused" in errors["image"]
    assert errors["text"] is None
    assert "an image_url part needs" in errors["bad-part"]
    assert "base64 payload is malformed" in errors["bad-url"]


def test_openai_batch_lines_with_image_url_parts(make_job, tmp_path):
    def line(custom_id: str, content: object) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": content}]}}

    lines = [line("image", [{"type": "text", "text": "What?"},
                            {"type": "image_url", "image_url": {"url": data_url(png_bytes(5)), "detail": "low"}}]),
             line("text", "Hello"),
             line("web", [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}])]
    write_rows(str(tmp_path / "in" / "part-0.jsonl"), lines)
    job = make_job(output_format="openai")
    [shard] = list_shards(job.input)
    process_shard(shard, job)
    out = [json.loads(text) for text in (tmp_path / "out" / "part-0.jsonl").read_text().splitlines()]
    by_id = {entry["custom_id"]: entry for entry in out}
    assert [entry["custom_id"] for entry in out] == ["image", "text", "web"]
    assert "image input" in by_id["image"]["error"]["message"] and "refused" in by_id["image"]["error"]["message"]
    assert by_id["text"]["error"] is None
    assert by_id["web"]["error"]["code"] == "invalid_image_url"
    assert "not in images.allowed_domains" in by_id["web"]["error"]["message"]


def test_the_feed_holds_at_most_its_prefetch_budget(tiny_model, tmp_path):
    from shardline import LLM

    images = [png_bytes(seed, size=(16, 16)) for seed in range(24)]
    rows = [{"id": str(n), "prompt": "<image>", "image": data} for n, data in enumerate(images)]
    rows.insert(5, {"id": "plain", "prompt": "hello", "image": None})
    write_rows(str(tmp_path / "in" / "part-0.parquet"), rows)
    budget = 3 * 16 * 16 * 3  # three decoded images
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=tiny_model,
                   sampling={"max_tokens": 2, "temperature": 0.0},
                   images={"column": "image", "prefetch_bytes": budget})
    prepared = read_shard(list_shards(job.input)[0], job)
    requests = [row.request for row in prepared.rows if row.request is not None]
    runner = ShardRunner(LLM(tiny_model, max_num_seqs=4))
    try:
        feed = ImageFeed(runner, job.images, {})
        results = feed.run_shard("part-0", requests)
    finally:
        runner.close()
    assert [result.index for result in results] == list(range(len(rows)))
    assert results[5].error is None and results[5].output is not None
    assert all(result.error and "cannot take image input" in result.error for n, result in enumerate(results) if n != 5)
    assert 0 < feed.peak_bytes <= budget


def test_s3_image_urls_in_an_s3_job(s3_server, make_job, monkeypatch):
    import s3fs

    monkeypatch.setenv("SHARDLINE_STORAGE_RETRY_SECONDS", "0")
    prefix, options = s3_server.new_prefix(), s3_server.storage_options()
    s3fs.S3FileSystem(**options, skip_instance_cache=True).pipe_file(f"{prefix}/img/a.png", png_bytes(8))
    rows = [{"id": "a", "prompt": "<image>", "image": f"s3://{prefix}/img/a.png"},
            {"id": "gone", "prompt": "<image>", "image": f"s3://{prefix}/img/gone.png"},
            {"id": "text", "prompt": "hello", "image": None}]
    write_rows(f"s3://{prefix}/in/part-0.jsonl", rows, options)
    job = make_job(input=f"s3://{prefix}/in", output=f"s3://{prefix}/out", storage_options=options,
                   images={"column": "image"})
    out = run_job(job)
    assert [row["id"] for row in out] == ["a", "gone", "text"]
    assert "cannot take image input" in out[0]["error"]  # read with the job's storage options, then refused
    assert out[1]["error"].startswith(f"row 1: s3://{prefix}/img/gone.png could not be read")
    assert out[2]["error"] is None
    assert s3_server.secret_key not in out[1]["error"]


def test_cli_flags_set_the_image_options(capsys):
    from shardline.cli import build_parser, job_from_args, main

    args = build_parser().parse_args(["run", "in", "out", "--model", "m", "--image-column", "img",
                                      "--allowed-media-domain", "example.com", "--max-image-bytes", "1000"])
    images = job_from_args(args).images
    assert (images.column, images.allowed_domains, images.max_image_bytes) == ("img", ["example.com"], 1000)
    assert images.prefetch_bytes == ImageOptions().prefetch_bytes
    assert main(["run", "in", "out", "--model", "m", "--max-image-bytes", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == ["shardline run: --max-image-bytes must be >= 1, got 0"]


def test_image_options_in_the_fingerprint(make_job):
    from shardline.tasks.fingerprint import fingerprint, fingerprint_fields
    from shardline.tasks.storage import Shard

    shard = Shard("file:///in/part-0.jsonl", "part-0", "jsonl", 10)

    def print_of(**images: object) -> str:
        return fingerprint(fingerprint_fields(make_job(images=images), shard, {"prompt": "string"}))

    assert "images" not in fingerprint_fields(make_job(), shard, {})  # jobs without images keep their prints
    assert print_of() == print_of(prefetch_bytes=1024)  # how far ahead images are read changes no output
    assert len({print_of(), print_of(column="image"), print_of(column="image", max_image_bytes=10),
                print_of(column="image", allowed_domains=["example.com"])}) == 4


def test_an_embed_job_takes_no_image_column(make_job):
    with pytest.raises(ValueError, match="images.column='image' applies to generate and chat jobs"):
        make_job(task="embed", images={"column": "image"})


def _requests_of(rows: list[dict], tmp_path, **images: object) -> tuple[BatchJob, list]:
    write_rows(str(tmp_path / "in" / "part-0.jsonl"), rows)
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model="unused",
                   images={"column": "image", **images})
    prepared = read_shard(list_shards(job.input)[0], job)
    return job, [row.request for row in prepared.rows if row.request is not None]


def test_an_abort_does_not_wait_for_a_slow_image(tiny_model, tmp_path):
    from shardline import LLM

    asked, release = threading.Event(), threading.Event()

    class SlowHost(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            asked.set()
            release.wait(60)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowHost)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rows = [{"prompt": "hello", "image": None},
            {"prompt": "<image>", "image": f"http://127.0.0.1:{server.server_address[1]}/slow.png"}]
    job, requests = _requests_of(rows, tmp_path, allowed_domains=["127.0.0.1"])
    runner = ShardRunner(LLM(tiny_model, max_num_seqs=4))
    feed = ImageFeed(runner, job.images, {})
    outcome: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(outcome, feed.run_shard, "part-0", requests))
    try:
        thread.start()
        assert asked.wait(30)
        assert feed.abort_shard("part-0")
        thread.join(30)  # a guard against a hang, not a measure of speed
        assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], ShardAborted)
    finally:
        release.set()
        server.shutdown()
        runner.close()


def test_a_failed_engine_host_fails_the_shard(tiny_model, tmp_path):
    from shardline import LLM

    job, requests = _requests_of([{"prompt": "<image>", "image": data_url(png_bytes(9))}], tmp_path)
    runner = ShardRunner(LLM(tiny_model, max_num_seqs=4))
    runner.close()
    with pytest.raises(RunnerError, match="closed"):
        ImageFeed(runner, job.images, {}).run_shard("part-0", requests)


def _capture(outcome: list[BaseException], call, *args) -> None:
    try:
        call(*args)
    except BaseException as exc:
        outcome.append(exc)


def test_decoded_images_cross_to_the_engine_service(service, tmp_path):  # noqa: F811 (the fixture)
    rows = [{"prompt": "<image>", "image": data_url(png_bytes(10))}, {"prompt": "hi", "image": None},
            {"prompt": "<image>", "image": data_url(b"not an image")}]
    job, requests = _requests_of(rows, tmp_path)
    results = ImageFeed(service, job.images, {}).run_shard("part-0", requests)
    assert [result.index for result in results] == [0, 1, 2]
    assert re.search(TEXT_MODEL_REFUSAL, results[0].error or "")  # the service's engine saw the image
    assert results[1].error is None and results[1].output is not None
    assert (results[2].error or "").startswith("row 2: image 1")
