"""Object storage through fsspec: listing shards, retried reads and atomic writes.

Any fsspec URL works (local path, file://, s3://, gs://, az://, memory://). Writes
go to a temporary key under ``<prefix>/_tmp/`` and are then moved to their final
key, so a reader sees a whole object or none: on local disks the move is a rename,
on object stores a server-side copy (which is atomic per key) plus a delete.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
from fsspec.spec import AbstractFileSystem

logger = logging.getLogger("shardline.tasks.storage")

T = TypeVar("T")

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".jsonl.zst", ".ndjson.zst")
_GLOB_CHARS = re.compile(r"[*?\[]")
# Errors a retry cannot fix: the object is not there, or we may not touch it.
_PERMANENT_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class StorageError(RuntimeError):
    """Storage could not be listed or written, with the URL and what went wrong."""


@dataclass(frozen=True)
class Shard:
    """One input shard: its URL, the key its outputs are named after, format and size.

    ``key`` is the shard's path relative to the input prefix without its extension
    (for a flat prefix, the file's stem); outputs go to ``<output>/<key>.parquet``.
    """

    uri: str
    key: str
    format: str
    size: int


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem for ``url`` and the path inside it."""
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def retry_storage(operation: Callable[[], T], what: str, attempts: int = 4, base_delay: float = 0.2) -> T:
    """Run a storage operation, retrying transient errors with exponential backoff."""
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except _PERMANENT_ERRORS:
            raise
        except (OSError, TimeoutError, ConnectionError) as exc:
            if attempt == attempts:
                raise
            delay = base_delay * 2 ** (attempt - 1)
            logger.warning("%s failed (%s: %s); retry %d of %d in %.1fs",
                           what, type(exc).__name__, exc, attempt, attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def shard_format(path: str, input_format: str = "auto") -> str | None:
    """'parquet' or 'jsonl' for a shard path, None when it is not a shard."""
    name = path.rsplit("/", 1)[-1].lower()
    if name.startswith(("_", ".")):
        return None  # _SUCCESS, _manifests, .crc and other bookkeeping files
    if input_format != "auto":
        return input_format
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


def _strip_suffix(name: str) -> str:
    for suffix in sorted(PARQUET_SUFFIXES + JSONL_SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name.rsplit(".", 1)[0] if "." in name else name


def list_shards(
    input_url: str,
    storage_options: dict[str, Any] | None = None,
    input_format: str = "auto",
    exclude: str | None = None,
) -> list[Shard]:
    """Every Parquet / JSON Lines shard under a prefix, a glob or a single file,
    sorted by key (a stable order). ``exclude`` is a prefix to skip (the output)."""
    fs, path = filesystem(input_url, storage_options)
    excluded = filesystem(exclude, storage_options)[1].rstrip("/") + "/" if exclude else None
    if _GLOB_CHARS.search(path):
        root = _GLOB_CHARS.split(path, 1)[0].rsplit("/", 1)[0]
        found = retry_storage(lambda: fs.glob(path, detail=True), f"listing {input_url}")
    elif retry_storage(lambda: fs.isfile(path), f"checking {input_url}"):
        root = path.rsplit("/", 1)[0]
        found = {path: fs.info(path)}
    else:
        root = path.rstrip("/")
        found = retry_storage(lambda: fs.find(path, detail=True), f"listing {input_url}")
    shards = []
    for found_path, info in found.items():
        found_path = found_path.rstrip("/")
        if info.get("type") == "directory" or (excluded and (found_path + "/").startswith(excluded)):
            continue
        relative = found_path[len(root):].lstrip("/") if found_path.startswith(root) else found_path
        fmt = shard_format(found_path, input_format)
        if fmt is None or any(part.startswith(("_", ".")) for part in relative.split("/")[:-1]):
            continue
        shards.append(Shard(fs.unstrip_protocol(found_path), _strip_suffix(relative), fmt, int(info.get("size") or 0)))
    if not shards:
        raise StorageError(
            f"no shards found at {input_url}: expected Parquet ({', '.join(PARQUET_SUFFIXES)}) "
            f"or JSON Lines ({', '.join(JSONL_SUFFIXES)}) files under that prefix or glob"
        )
    _check_unique_keys(shards)
    return sorted(shards, key=lambda shard: shard.key)


def _check_unique_keys(shards: list[Shard]) -> None:
    by_key: dict[str, list[str]] = {}
    for shard in shards:
        by_key.setdefault(shard.key, []).append(shard.uri)
    clashes = {key: uris for key, uris in by_key.items() if len(uris) > 1}
    if clashes:
        key, uris = next(iter(sorted(clashes.items())))
        raise StorageError(
            f"shards {', '.join(sorted(uris))} would all write output {key!r}; rename one of them"
        )


def join(prefix: str, *parts: str) -> str:
    """``prefix/part/...`` for URLs and paths alike."""
    return "/".join([prefix.rstrip("/"), *(p.strip("/") for p in parts)])


def read_bytes(uri: str, storage_options: dict[str, Any] | None = None, compression: str | None = None) -> bytes:
    """The whole object at ``uri`` (decompressed when ``compression='infer'``), retried."""
    fs, path = filesystem(uri, storage_options)

    def read() -> bytes:
        with fs.open(path, "rb", compression=compression) as handle:
            return handle.read()

    return retry_storage(read, f"reading {uri}")


def write_atomic(uri: str, data: bytes, storage_options: dict[str, Any] | None = None) -> None:
    """Write ``data`` to ``uri`` so that readers see all of it or nothing.

    The bytes go to ``<dir>/_tmp/<name>.<uuid>`` first and are moved into place once
    whole; a crash leaves at most a stray temporary object, never a partial one.
    """
    fs, path = filesystem(uri, storage_options)
    directory, name = path.rsplit("/", 1)
    temp_path = f"{directory}/_tmp/{name}.{uuid.uuid4().hex}"
    retry_storage(lambda: fs.makedirs(f"{directory}/_tmp", exist_ok=True), f"creating {directory}/_tmp")
    retry_storage(lambda: fs.pipe_file(temp_path, data), f"writing {fs.unstrip_protocol(temp_path)}")
    try:
        retry_storage(lambda: fs.mv(temp_path, path), f"committing {uri}")
    finally:
        if retry_storage(lambda: fs.exists(temp_path), "checking temporary object"):
            fs.rm(temp_path)


def remove_stale_temporaries(uri: str, storage_options: dict[str, Any] | None = None) -> int:
    """Delete temporary objects a killed run left for ``uri``; return how many."""
    fs, path = filesystem(uri, storage_options)
    directory, name = path.rsplit("/", 1)
    stale = retry_storage(lambda: fs.glob(f"{directory}/_tmp/{name}.*"), f"listing {directory}/_tmp")
    for temp_path in stale:
        fs.rm(temp_path)
    return len(stale)


def exists(uri: str, storage_options: dict[str, Any] | None = None) -> bool:
    fs, path = filesystem(uri, storage_options)
    return retry_storage(lambda: fs.exists(path), f"checking {uri}")
