"""Reading Parquet and JSON Lines shards: records, schema, bad lines, unreadable shards."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.tasks.shard_reader import RecordProblem, ShardError, read_input_schema, read_shard_records
from shardline.tasks.storage import list_shards


def _shard(path):
    return list_shards(str(path))[0]


def test_parquet_records_schema_and_nan_overrides(tmp_path):
    pq.write_table(pa.table({"prompt": ["a", "b"], "temperature": [0.5, float("nan")]}), tmp_path / "s.parquet")
    raw = read_shard_records(_shard(tmp_path / "s.parquet"))
    assert raw.records == [{"prompt": "a", "temperature": 0.5}, {"prompt": "b", "temperature": None}]
    assert raw.schema == {"prompt": "string", "temperature": "double"}
    assert read_input_schema(raw.shard) == raw.schema
    assert raw.pass_through_array("temperature").type == pa.float64()


def test_jsonl_bad_lines_become_problems_in_place(tmp_path):
    lines = [json.dumps({"prompt": "a"}), "{not json", "[1, 2]", json.dumps({"prompt": "b", "n": 1})]
    (tmp_path / "s.jsonl").write_text("\n".join(lines) + "\n")
    raw = read_shard_records(_shard(tmp_path / "s.jsonl"))
    assert len(raw.records) == 4
    assert raw.records[0] == {"prompt": "a"} and raw.records[3] == {"prompt": "b", "n": 1}
    assert isinstance(raw.records[1], RecordProblem) and "line 2 is not valid JSON" in raw.records[1].message
    assert "line 3 is a JSON array" in raw.records[2].message
    assert raw.schema == {"n": "integer", "prompt": "string"}


def test_gzipped_jsonl_and_mixed_pass_through(tmp_path):
    with gzip.open(tmp_path / "s.jsonl.gz", "wt") as handle:
        handle.write(json.dumps({"prompt": "a", "meta": 1}) + "\n" + json.dumps({"prompt": "b", "meta": "x"}) + "\n")
    raw = read_shard_records(_shard(tmp_path / "s.jsonl.gz"))
    assert raw.shard.key == "s" and [r["prompt"] for r in raw.records] == ["a", "b"]
    assert raw.pass_through_array("meta").to_pylist() == ["1", '"x"']  # mixed types kept as JSON text


def test_unreadable_shards_raise_shard_error(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(ShardError, match=r"^read \S*bad.parquet failed: not a readable Parquet file"):
        read_shard_records(_shard(tmp_path / "bad.parquet"))
    with pytest.raises(ShardError, match=r"^read \S*bad.parquet failed: not a readable Parquet file"):
        read_input_schema(_shard(tmp_path / "bad.parquet"))
    (tmp_path / "bin.jsonl").write_bytes(b"\x00\x01garbage\nmore garbage\n")
    with pytest.raises(ShardError, match=r"^read \S*bin.jsonl failed: not JSON Lines"):
        read_shard_records(_shard(tmp_path / "bin.jsonl"))


def test_truncated_and_corrupt_gzip_name_the_file_and_fail_at_once(tmp_path, caplog):
    whole = gzip.compress(b"".join(json.dumps({"prompt": f"p{i}"}).encode() + b"\n" for i in range(200)))
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "junk.jsonl.gz").write_bytes(b"not gzip at all")
    for name in ("cut.jsonl.gz", "junk.jsonl.gz"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="shardline.tasks.storage"), pytest.raises(ShardError) as raised:
            read_shard_records(_shard(tmp_path / name))
        # Corrupt is permanent: no storage retries (a retry logs "retry N in ...").
        assert not [r for r in caplog.records if "; retry " in r.getMessage()], caplog.text
        message = str(raised.value)
        assert message.startswith(f"read {tmp_path / name}") or message.startswith(f"read file://{tmp_path / name}")
        assert "not a readable gzip file, truncated or corrupt" in message and "\n" not in message
    assert "EOFError" in str(raised.value) or "BadGzipFile" in str(raised.value)
