"""One shard end to end without Prefect: the output contract, the manifest, resume checks, aborts."""

from __future__ import annotations

import contextlib
import json
import threading

import pyarrow.parquet as pq
import pytest

from shardline import LLM, SamplingParams
from shardline.tasks import engine_cache
from shardline.tasks.executor import ShardAborted
from shardline.tasks.sample_data import write_rows
from shardline.tasks.shard_job import ShardPipeline, process_shard
from shardline.tasks.shard_writer import completed_manifest, shard_is_done
from shardline.tasks.shutdown import ShutdownRequested, clear_shutdown, mark_shutdown
from shardline.tasks.storage import list_shards

from ..waiting import wait_for

ROWS = [
    {"id": "r0", "prompt": "Write one line about the sea.", "topic": "sea"},
    {"id": "r1", "prompt": "", "topic": "empty"},
    {"id": "r2", "prompt": "Two plus two", "topic": "math", "max_tokens": 2},
]


def _one_shard(tmp_path, rows=ROWS, name="part-0.parquet"):
    write_rows(str(tmp_path / "in" / name), rows)
    return list_shards(str(tmp_path / "in"))[0]


def test_output_contract_and_manifest(tmp_path, make_job, tiny_model):
    shard = _one_shard(tmp_path)
    job = make_job(pass_through=["topic"])
    manifest = process_shard(shard, job)
    table = pq.read_table(tmp_path / "out" / "part-0.parquet")
    assert table.column_names == ["id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "error",
                                  "topic"]
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == ["r0", "r1", "r2"] and [r["topic"] for r in rows] == ["sea", "empty", "math"]
    assert rows[1]["error"] == "the prompt is empty" and rows[1]["text"] is None
    assert rows[0]["error"] is None and rows[0]["completion_tokens"] == 4 and rows[2]["completion_tokens"] == 2

    expected = LLM(tiny_model).generate([ROWS[0]["prompt"]], SamplingParams(max_tokens=4, temperature=0.0),
                                        use_tqdm=False)[0]
    assert rows[0]["text"] == expected.outputs[0].text
    assert rows[0]["prompt_tokens"] == len(expected.prompt_token_ids)

    on_disk = json.loads((tmp_path / "out" / "_manifests" / "part-0.json").read_text())
    assert on_disk == manifest.to_json()
    assert (manifest.rows, manifest.errors, manifest.completion_tokens) == (3, 1, 6)
    assert set(manifest.seconds) == {"read", "run", "write"}
    assert manifest.job["sampling"]["max_tokens"] == 4 and manifest.job["model"] == tiny_model
    assert manifest.job["input_schema"]["prompt"] == "string"
    assert not list((tmp_path / "out" / "_tmp").iterdir())


def test_done_only_while_the_fingerprint_matches(tmp_path, make_job):
    shard = _one_shard(tmp_path)
    job = make_job()
    assert not shard_is_done(shard, job)
    process_shard(shard, job)
    assert shard_is_done(shard, job) and completed_manifest(shard, job).rows == 3
    assert not shard_is_done(shard, make_job(sampling={"max_tokens": 5, "temperature": 0.0}))
    assert not shard_is_done(shard, make_job(engine_options={"max_num_seqs": 8}))
    assert not shard_is_done(shard, make_job(revision="v2"))
    assert shard_is_done(shard, make_job(storage_options={"anon": False}))  # credentials are not outputs
    (tmp_path / "out" / "part-0.parquet").unlink()
    assert not shard_is_done(shard, job)


def test_n_samples_write_texts(tmp_path, make_job):
    shard = _one_shard(tmp_path, ROWS[:1], name="part-0.jsonl")
    process_shard(shard, make_job(sampling={"max_tokens": 3, "temperature": 1.0, "n": 3, "seed": 1}))
    row = pq.read_table(tmp_path / "out" / "part-0.parquet").to_pylist()[0]
    assert len(row["texts"]) == 3 and row["finish_reason"] == ["length"] * 3 and row["completion_tokens"] == 9


def test_chat_rows(tmp_path, make_job, tiny_model):
    messages = [{"role": "user", "content": "Hello there"}]
    shard = _one_shard(tmp_path, [{"messages": messages}, {"messages": [{"role": "user"}]}])
    process_shard(shard, make_job(task="chat"))
    rows = pq.read_table(tmp_path / "out" / "part-0.parquet").to_pylist()
    expected = LLM(tiny_model).chat([messages], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert rows[0]["text"] == expected.outputs[0].text and rows[0]["error"] is None
    assert "malformed messages" in rows[1]["error"]


def test_embed_rows(tmp_path, make_job, embedding_model):
    shard = _one_shard(tmp_path, [{"prompt": "a sentence"}, {"prompt": ""}])
    process_shard(shard, make_job(task="embed", model=embedding_model, engine_options={}))
    table = pq.read_table(tmp_path / "out" / "part-0.parquet")
    assert table.column_names == ["id", "embedding", "prompt_tokens", "error"]
    rows = table.to_pylist()
    expected = LLM(embedding_model).embed(["a sentence"])[0].outputs.embedding
    assert rows[0]["embedding"] == pytest.approx(expected, abs=1e-5) and len(rows[0]["embedding"]) == 384
    assert rows[1]["error"] and rows[1]["embedding"] is None


def test_abort_stops_a_running_shard_and_commits_nothing(tmp_path, make_job):
    shard = _one_shard(tmp_path, [{"prompt": f"Row {index}"} for index in range(4)])
    job = make_job(sampling={"max_tokens": 900, "temperature": 0.0, "ignore_eos": True})
    engine = engine_cache.get_engine(job.model, **job.engine_kwargs()).llm_engine  # the one the pipeline uses
    pipeline, outcome = ShardPipeline(job), []

    def run() -> None:
        try:
            pipeline.process(shard)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    wait_for(engine.has_unfinished_requests, "rows in the engine")
    pipeline.abort()
    worker.join(timeout=120)
    assert len(outcome) == 1 and isinstance(outcome[0], ShardAborted)
    assert not engine.has_unfinished_requests() and not (tmp_path / "out" / "part-0.parquet").exists()
    with pytest.raises(ShardAborted, match="aborted"):  # an aborted pipeline starts no shard
        pipeline.process(shard)


@pytest.mark.parametrize("stop", ["abort", "shutdown"])
def test_a_stop_after_the_last_row_commits_nothing(tmp_path, make_job, stop):
    """The check before writing: the rows came back, but the pipeline was stopped meanwhile."""
    shard = _one_shard(tmp_path)
    pipeline: ShardPipeline

    @contextlib.contextmanager
    def stopped_on_release(_shard):
        yield
        pipeline.abort() if stop == "abort" else mark_shutdown("a test")

    pipeline = ShardPipeline(make_job(), engine_slot=stopped_on_release)
    try:
        with pytest.raises(ShutdownRequested if stop == "shutdown" else ShardAborted, match="write of shard part-0"):
            pipeline.process(shard)
    finally:
        clear_shutdown()
    assert not (tmp_path / "out" / "_manifests").exists() and not (tmp_path / "out" / "part-0.parquet").exists()


def test_skip_done_returns_the_committed_manifest_without_engine_work(tmp_path, make_job):
    shard = _one_shard(tmp_path)
    job = make_job()
    manifest = process_shard(shard, job)
    requests = engine_cache.engine_requests()
    assert ShardPipeline(job).process(shard, skip_done=True) == manifest
    assert engine_cache.engine_requests() == requests
