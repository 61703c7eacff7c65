"""The batch_inference flow for real under Prefect: order, artifacts, resume,
fingerprints, failing shards and a poison row."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from shardline.flows.batch_inference import batch_inference
from shardline.tasks import engine_cache
from shardline.tasks.sample_data import write_rows, write_sample_dataset
from shardline.tasks.shard_reader import read_shard_records
from shardline.tasks.storage import list_shards
from shardline.tasks.summary import ShardsFailed

from .helpers import flow_run_record, output_ids


def _input_ids(shard) -> list[str]:
    return [r.get("id") or f"{shard.key}:{i}" for i, r in enumerate(read_shard_records(shard).records)]


def _manifest(tmp_path, key: str) -> dict:
    return json.loads((tmp_path / "out" / "_manifests" / f"{key}.json").read_text())


def test_twelve_mixed_shards_in_order_with_artifacts_then_resume_and_refingerprint(tmp_path, make_job):
    write_sample_dataset(str(tmp_path / "in"), num_shards=12, rows_per_shard=5)
    job = make_job(pass_through=["topic"], shards_in_flight=3)
    state = batch_inference(job, return_state=True)
    summary = state.result()
    totals = summary["totals"]
    assert (totals["shards"], totals["done"], totals["failed"], totals["rows"], totals["errors"]) == (12, 12, 0, 63, 3)

    shards = list_shards(job.input)
    assert {s.format for s in shards} == {"parquet", "jsonl"}
    for shard in shards:
        assert output_ids(tmp_path / "out" / f"{shard.key}.parquet") == _input_ids(shard)
    errors = [e for s in shards for e in pq.read_table(tmp_path / "out" / f"{s.key}.parquet")["error"].to_pylist() if e]
    assert sorted(errors)[0].startswith("max_tokens must be >= 1") and len(errors) == 3

    record = flow_run_record(state.state_details.flow_run_id)
    table = record["artifacts"]["batch-inference-shards"]
    table_rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [row["shard"] for row in table_rows] == [s.key for s in shards]
    assert sum(row["rows"] for row in table_rows) == 63
    assert "completion tok/s" in record["artifacts"]["batch-inference-summary"].data
    assert record["artifacts"]["batch-inference-progress"].data == 100.0

    first_written = {s.key: _manifest(tmp_path, s.key)["written_at"] for s in shards}
    again = batch_inference(job)
    assert again["totals"]["skipped"] == 12 and again["totals"]["done"] == 0
    assert {s.key: _manifest(tmp_path, s.key)["written_at"] for s in shards} == first_written

    longer = make_job(pass_through=["topic"], sampling={"max_tokens": 6, "temperature": 0.0})
    redone = batch_inference(longer)
    assert redone["totals"]["done"] == 12
    assert redone["totals"]["completion_tokens"] == 60 * 6
    assert all(_manifest(tmp_path, s.key)["job"]["sampling"]["max_tokens"] == 6 for s in shards)


def test_unreadable_and_schemaless_shards_fail_alone(tmp_path, make_job):
    write_sample_dataset(str(tmp_path / "in"), num_shards=3, rows_per_shard=3, with_bad_rows=False)
    (tmp_path / "in" / "part-corrupt.parquet").write_bytes(b"PAR1 truncated garbage")
    write_rows(str(tmp_path / "in" / "part-noprompt.jsonl"), [{"question": "what?"}])
    with pytest.raises(ShardsFailed) as failure:
        batch_inference(make_job())
    summary = failure.value.summary
    by_shard = {entry["shard"]: entry for entry in summary["shards"]}
    assert [k for k, e in by_shard.items() if e["status"] == "done"] == ["part-00000", "part-00001", "part-00002"]
    assert "part-corrupt.parquet failed: not a readable Parquet file" in by_shard["part-corrupt"]["message"]
    assert "no 'prompt' column, which task=generate needs (columns: question)" in by_shard["part-noprompt"]["message"]
    assert "2 of 5 shard(s) failed" in str(failure.value)
    assert not (tmp_path / "out" / "part-corrupt.parquet").exists()
    assert (tmp_path / "out" / "part-00002.parquet").exists()


def test_poison_row_is_isolated_inside_the_flow(tmp_path, make_job):
    rows = [{"id": f"r{i}", "prompt": f"row {i} about the sea"} for i in range(8)]
    rows[3]["prompt"] = "<|system|> poison"
    write_rows(str(tmp_path / "in" / "a.parquet"), rows)
    write_rows(str(tmp_path / "in" / "b.jsonl"), [{"prompt": "a clean shard"}] * 4)
    job = make_job()
    llm = engine_cache.get_engine(job.model, **job.engine_kwargs())  # the engine the flow's tasks will share
    poison_id = llm.get_tokenizer().convert_tokens_to_ids("<|system|>")

    def fail_on_poison(module, args):
        if (args[0] == poison_id).any():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    llm.llm_engine.model.get_input_embeddings().register_forward_pre_hook(fail_on_poison)
    summary = batch_inference(job)
    assert summary["totals"]["errors"] == 1 and summary["totals"]["done"] == 2
    out = pq.read_table(tmp_path / "out" / "a.parquet").to_pylist()
    assert [r["id"] for r in out] == [f"r{i}" for i in range(8)]
    assert "illegal memory access" in out[3]["error"] and "bisection" in out[3]["error"]
    assert all(r["error"] is None and r["completion_tokens"] == 4 for i, r in enumerate(out) if i != 3)
    assert engine_cache.num_cached_engines() == 0  # the flow closed it
