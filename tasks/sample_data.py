"""A small sample dataset of prompt shards (Parquet and JSON Lines, a few bad rows).

Used by ``shardline demo``, the tests and the benchmark; writes through fsspec, so
the target may be any URL.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .storage import filesystem, join

_TOPICS = ("the sea", "a paged cache", "batch inference", "the lazy dog", "Tokyo", "a short poem",
           "continuous batching", "two plus two", "bonjour", "object storage")

# (what is wrong, the row) — each becomes an error row that names the problem.
BAD_ROWS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("empty prompt", {"prompt": ""}),
    ("negative max_tokens", {"prompt": "Count to ten.", "max_tokens": -3}),
    ("unknown LoRA adapter", {"prompt": "Say hi.", "lora": "no-such-adapter"}),
)


def sample_prompts(num_rows: int, shard_index: int = 0) -> list[dict[str, Any]]:
    """``num_rows`` prompt rows with ids and a passed-through ``topic`` column."""
    rows = []
    for row in range(num_rows):
        topic = _TOPICS[(shard_index * 7 + row) % len(_TOPICS)]
        rows.append({"id": f"s{shard_index:02d}-{row:03d}", "prompt": f"Write one line about {topic}.",
                     "topic": topic})
    return rows


def write_rows(uri: str, rows: list[dict[str, Any]], storage_options: dict[str, Any] | None = None) -> str:
    """Write ``rows`` to ``uri`` as Parquet or JSON Lines (by extension); return ``uri``."""
    fs, path = filesystem(uri, storage_options)
    if path.endswith(".parquet"):
        buffer = io.BytesIO()
        names = list(dict.fromkeys(name for row in rows for name in row))  # every column, first-seen order
        pq.write_table(pa.Table.from_pylist([{n: row.get(n) for n in names} for row in rows]), buffer)
        data = buffer.getvalue()
    else:
        data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    fs.pipe_file(path, data)
    return uri


def write_sample_dataset(
    prefix: str,
    num_shards: int = 6,
    rows_per_shard: int = 8,
    with_bad_rows: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Write ``num_shards`` shards under ``prefix``, alternating Parquet and JSON Lines;
    the first shards get one bad row each. Returns the shard URIs."""
    uris = []
    for index in range(num_shards):
        rows = sample_prompts(rows_per_shard, index)
        if with_bad_rows and index < len(BAD_ROWS):
            problem, bad_row = BAD_ROWS[index]
            rows.insert(len(rows) // 2, {"id": f"s{index:02d}-bad", "topic": problem, "prompt": None,
                                         "max_tokens": None, "lora": None, **bad_row})
        suffix = "parquet" if index % 2 == 0 else "jsonl"
        uris.append(write_rows(join(prefix, f"part-{index:05d}.{suffix}"), rows, storage_options))
    return uris
