"""Listing shards and atomic writes on local paths, file:// and memory://."""

from __future__ import annotations

import time
import uuid

import fsspec
import pytest

from shardline.tasks.errors import ErrorKind, JobError, StorageNotFound
from shardline.tasks.retrying import StorageRetry
from shardline.tasks.sample_data import write_rows
from shardline.tasks.storage import StorageError, list_shards, read_bytes, retry_storage, write_atomic


def _touch(prefix: str, *names: str) -> None:
    for name in names:
        if name.endswith((".parquet", ".jsonl")):
            write_rows(f"{prefix}/{name}", [{"prompt": name}])
        else:
            fs, path = fsspec.core.url_to_fs(f"{prefix}/{name}")
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            fs.pipe_file(path, b"x")


@pytest.mark.parametrize("scheme", ["path", "file", "memory"])
def test_lists_a_prefix_sorted_with_formats_and_keys(tmp_path, scheme):
    prefix = {"path": str(tmp_path / "in"), "file": f"file://{tmp_path}/in",
              "memory": f"memory://list-{uuid.uuid4().hex}"}[scheme]
    _touch(prefix, "b.jsonl", "a.parquet", "sub/c.parquet", "_SUCCESS", "notes.txt", "_tmp/x.parquet")
    shards = list_shards(prefix)
    assert [(s.key, s.format) for s in shards] == [("a", "parquet"), ("b", "jsonl"), ("sub/c", "parquet")]
    assert all(s.size > 0 for s in shards)
    assert [list_shards(s.uri)[0].key for s in shards] == ["a", "b", "c"]  # a single file is a shard too


def test_glob_and_output_exclusion(tmp_path):
    prefix = str(tmp_path / "data")
    _touch(prefix, "p-0.parquet", "p-1.jsonl", "q-0.parquet", "out/p-9.parquet")
    assert [s.key for s in list_shards(f"{prefix}/p-*")] == ["p-0", "p-1"]
    assert [s.key for s in list_shards(prefix, exclude=f"{prefix}/out")] == ["p-0", "p-1", "q-0"]


def test_forced_format_and_errors(tmp_path):
    prefix = str(tmp_path / "data")
    _touch(prefix, "a.parquet", "a.jsonl")
    with pytest.raises(StorageError, match="would all write output 'a'"):
        list_shards(prefix)
    with pytest.raises(StorageError, match="list .*empty failed: no shards under it.*Parquet"):
        list_shards(str(tmp_path / "empty"))


def test_write_atomic_leaves_only_the_object(tmp_path):
    target = str(tmp_path / "out" / "x.bin")
    write_atomic(target, b"hello")
    write_atomic(target, b"world")
    assert read_bytes(target) == b"world"
    assert list((tmp_path / "out" / "_tmp").iterdir()) == []


def test_retry_storage_retries_transient_errors_only():
    calls = []
    quick = StorageRetry(total_seconds=5, base_delay=0.001)

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("connection reset")
        return "ok"

    assert retry_storage(flaky, "read", "memory://x", policy=quick) == "ok" and len(calls) == 3

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("nope")

    calls.clear()
    with pytest.raises(StorageNotFound, match="^read memory://x failed: FileNotFoundError: nope") as raised:
        retry_storage(missing, "read", "memory://x", policy=quick)
    assert len(calls) == 1 and raised.value.kind is ErrorKind.PERMANENT
    assert isinstance(raised.value, FileNotFoundError)  # callers may still catch it as such


def test_retry_storage_gives_up_after_its_time_budget_naming_the_object():
    calls = []

    def down() -> None:
        calls.append(time.monotonic())
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(StorageError) as raised:
        retry_storage(down, "write", "s3://bucket/out/a.parquet", policy=StorageRetry(total_seconds=0.5,
                                                                                        base_delay=0.05))
    assert raised.value.kind is ErrorKind.TRANSIENT and len(calls) > 2
    assert calls[-1] - calls[0] <= 0.5
    assert str(raised.value).startswith("write s3://bucket/out/a.parquet failed: ConnectionRefusedError")
    assert "SHARDLINE_STORAGE_RETRY_SECONDS" in str(raised.value)


def test_storage_retry_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SHARDLINE_STORAGE_RETRY_SECONDS", "90")
    assert StorageRetry.from_env().total_seconds == 90
    monkeypatch.setenv("SHARDLINE_STORAGE_RETRY_SECONDS", "soon")
    with pytest.raises(JobError, match="^check SHARDLINE_STORAGE_RETRY_SECONDS failed: must be .* got 'soon'"):
        StorageRetry.from_env()
