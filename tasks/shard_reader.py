"""Reading one input shard (Parquet or JSON Lines) into records and a schema.

A shard that cannot be read at all (not Parquet, not JSON Lines, a truncated or
corrupt compressed file, no usable column) raises ShardError, a permanent error
naming the shard's URL: that shard fails with the message, the others go on. The
object's bytes are fetched first (storage errors are retried there) and decoded
after, so a corrupt object is never retried as if the store had failed. A single bad
JSON line does not fail its shard: it becomes a record carrying a ``RecordProblem``,
which turns into an error row, so the output still has one row per input line.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.compression import compr
from fsspec.utils import infer_compression

from .errors import PipelineError
from .storage import Shard, filesystem, read_bytes, retry_storage


class ShardError(PipelineError):
    """A whole shard cannot be processed (permanent): ``read <shard URL> failed: <why>``."""

    def __init__(self, uri: str, reason: str) -> None:
        super().__init__("read", uri, reason)

    def __reduce__(self) -> tuple:
        return (ShardError, (self.target, self.reason))


@dataclass(frozen=True)
class RecordProblem:
    """Why one input line could not be parsed into a record."""

    message: str


@dataclass
class RawShard:
    """A shard's rows as Python records plus its schema.

    ``records[i]`` is the i-th input row (a dict) or a RecordProblem; ``schema`` maps
    column name to type name and is part of the job fingerprint; ``columns`` keeps
    the original Arrow columns of a Parquet shard for pass-through.
    """

    shard: Shard
    records: list[dict[str, Any] | RecordProblem]
    schema: dict[str, str]
    columns: dict[str, pa.ChunkedArray] = field(default_factory=dict)

    def pass_through_array(self, name: str) -> pa.Array:
        """The column ``name`` as an Arrow array of one value per input row."""
        if name in self.columns:
            return self.columns[name].combine_chunks()
        values = [r.get(name) if isinstance(r, dict) else None for r in self.records]
        try:
            return pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            # Mixed JSON types in one column: keep every value, as JSON text.
            return pa.array([None if v is None else json.dumps(v) for v in values], pa.string())


def read_shard_records(shard: Shard, storage_options: dict[str, Any] | None = None) -> RawShard:
    """Read ``shard`` into a RawShard; raise ShardError when it is unreadable."""
    if shard.format == "parquet":
        return _read_parquet(shard, storage_options)
    if shard.format in ("jsonl", "openai"):  # OpenAI Batch request files are JSON Lines
        return _read_jsonl(shard, storage_options)
    raise ShardError(shard.uri, f"unknown shard format {shard.format!r}; expected parquet, jsonl or openai")


def read_input_schema(shard: Shard, storage_options: dict[str, Any] | None = None) -> dict[str, str]:
    """The shard's schema as in ``RawShard.schema``; reads only the footer of Parquet."""
    if shard.format == "parquet":
        fs, path = filesystem(shard.uri, storage_options)

        def read_schema() -> pa.Schema:
            with fs.open(path, "rb") as handle:
                try:
                    return pq.read_schema(handle)
                except OSError:
                    raise  # the store failed (ArrowIOError too): retried or reported as storage
                except (pa.ArrowException, ValueError) as exc:  # the bytes came; they are not Parquet
                    raise ShardError(shard.uri, f"not a readable Parquet file ({exc})") from exc

        return _arrow_schema(retry_storage(read_schema, "read", shard.uri, fs))
    return read_shard_records(shard, storage_options).schema


def _arrow_schema(schema: pa.Schema) -> dict[str, str]:
    return {f.name: str(f.type) for f in schema}


def _read_parquet(shard: Shard, storage_options: dict[str, Any] | None) -> RawShard:
    data = read_bytes(shard.uri, storage_options)
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise ShardError(shard.uri, f"not a readable Parquet file ({exc})") from exc
    records: list[dict[str, Any] | RecordProblem] = [_drop_nans(record) for record in table.to_pylist()]
    columns = {name: table.column(name) for name in table.column_names}
    return RawShard(shard, records, _arrow_schema(table.schema), columns)


def _drop_nans(record: dict[str, Any]) -> dict[str, Any]:
    # pandas writes missing floats as NaN; a NaN override means "not given".
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()}


def _read_jsonl(shard: Shard, storage_options: dict[str, Any] | None) -> RawShard:
    data = _decompressed(shard.uri, read_bytes(shard.uri, storage_options))
    lines = data.split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()  # the file's final newline ends the last row; it does not start one
    records: list[dict[str, Any] | RecordProblem] = []
    types: dict[str, set[str]] = {}
    for number, line in enumerate(lines, start=1):
        record = _parse_line(line, number)
        records.append(record)
        if isinstance(record, dict):
            for key, value in record.items():
                types.setdefault(key, set()).add(_json_type(value))
    if records and not types:
        first = records[0]
        assert isinstance(first, RecordProblem), "a line that parsed to an object has its keys in types"
        raise ShardError(shard.uri, f"not JSON Lines: none of its {len(records)} line(s) is a JSON object "
                         f"(line 1: {first.message})")
    schema = {key: "|".join(sorted(names)) for key, names in sorted(types.items())}
    return RawShard(shard, records, schema)


def _decompressed(uri: str, data: bytes) -> bytes:
    """``data`` decompressed as the name's suffix says (.gz, .zst, ...); as is otherwise."""
    codec = infer_compression(uri)
    if codec is None:
        return data
    # fsspec's codec -> opener registry, untyped (pyright reads its key type off its one literal entry, None).
    openers: dict[Any, Any] = compr
    try:
        with openers[codec](io.BytesIO(data), mode="rb") as stream:
            return stream.read()
    except Exception as exc:  # EOFError (truncated), BadGzipFile, zstd errors: all mean corrupt
        raise ShardError(uri, f"not a readable {codec} file, truncated or corrupt "
                              f"({type(exc).__name__}: {exc})") from exc


def _parse_line(line: bytes, number: int) -> dict[str, Any] | RecordProblem:
    try:
        value = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return RecordProblem(f"line {number} is not UTF-8 text ({exc.reason} at byte {exc.start})")
    except json.JSONDecodeError as exc:
        snippet = line[:80].decode("utf-8", "replace")
        return RecordProblem(f"line {number} is not valid JSON ({exc.msg} at column {exc.colno}): {snippet!r}")
    if not isinstance(value, dict):
        return RecordProblem(f"line {number} is a JSON {_json_type(value)}, expected an object with a prompt")
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
