"""Object storage through fsspec: listing shards, retried reads and atomic writes.

Any fsspec URL works (local path, file://, s3://, gs://, az://, memory://). Writes
go to a temporary key under ``<prefix>/_tmp/`` and are then moved to their final
key, so a reader sees a whole object or none: on local disks the move is a rename,
on object stores a server-side copy (which is atomic per key) plus a delete.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, cast

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

from .errors import NoShardsFound, StorageError, StorageNotFound
from .retrying import retry_storage

__all__ = ["NoShardsFound", "Shard", "StorageError", "exists", "filesystem", "join", "list_shards", "make_directory",
           "read_bytes", "remove_stale_temporaries", "retry_storage", "write_atomic"]

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".jsonl.zst", ".ndjson.zst")
_GLOB_CHARS = re.compile(r"[*?\[]")
# An fsspec listing with detail=True: path -> info (type, size, ...).
_Listing = dict[str, dict[str, Any]]


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
    """The fsspec filesystem for ``url`` and the path inside it.

    A URL fsspec cannot open (an unknown protocol, a missing s3fs) is a permanent
    StorageError naming it."""
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ValueError, ImportError, TypeError) as exc:
        raise StorageError("open", url, f"{type(exc).__name__}: {exc}") from exc


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
    sorted by key (a stable order). ``exclude`` is a prefix to skip (the output).

    Raises NoShardsFound when there is none, StorageError when listing fails."""
    fs, path = filesystem(input_url, storage_options)
    excluded = filesystem(exclude, storage_options)[1].rstrip("/") + "/" if exclude else None
    # fsspec's listings are untyped; with detail=True they map each path to its info dict.
    if _GLOB_CHARS.search(path):
        root = _GLOB_CHARS.split(path, 1)[0].rsplit("/", 1)[0]
        found = cast(_Listing, retry_storage(lambda: fs.glob(path, detail=True), "list", input_url, fs))
    elif retry_storage(lambda: fs.isfile(path), "list", input_url, fs):
        root = path.rsplit("/", 1)[0]
        found = {path: retry_storage(lambda: fs.info(path), "list", input_url, fs)}
    else:
        root = path.rstrip("/")
        # No bucket: raises.
        found = cast(_Listing, retry_storage(lambda: fs.find(path, detail=True), "list", input_url, fs))
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
        raise NoShardsFound(
            "list", input_url, f"no shards under it: expected Parquet ({', '.join(PARQUET_SUFFIXES)}) "
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
        raise StorageError("list", key, f"shards {', '.join(sorted(uris))} would all write output {key!r}; "
                           "rename one of them")


def join(prefix: str, *parts: str) -> str:
    """``prefix/part/...`` for URLs and paths alike."""
    return "/".join([prefix.rstrip("/"), *(p.strip("/") for p in parts)])


def read_bytes(uri: str, storage_options: dict[str, Any] | None = None) -> bytes:
    """The whole object at ``uri``, as stored (no decompression: a corrupt object
    must fail as corrupt, not be retried as a storage error)."""
    fs, path = filesystem(uri, storage_options)
    return cast(bytes, retry_storage(lambda: fs.cat_file(path), "read", uri, fs))  # fsspec: untyped, bytes


def write_atomic(uri: str, data: bytes, storage_options: dict[str, Any] | None = None) -> None:
    """Write ``data`` to ``uri`` so that readers see all of it or nothing.

    The bytes go to ``<dir>/_tmp/<name>.<uuid>`` first and are moved into place once
    whole; a crash leaves at most a stray temporary object, never a partial one.
    Each step is retried on its own and is idempotent (a commit whose reply was lost
    is not redone from scratch), so an outage mid-write costs a wait, never the data.
    """
    fs, path = filesystem(uri, storage_options)
    directory, name = path.rsplit("/", 1)
    temp_path = f"{directory}/_tmp/{name}.{uuid.uuid4().hex}"
    make_directory(fs, f"{directory}/_tmp", uri)
    retry_storage(lambda: fs.pipe_file(temp_path, data), "write", uri, fs)
    if isinstance(fs, LocalFileSystem):
        retry_storage(lambda: fs.mv(temp_path, path), "commit", uri, fs)  # a rename
    else:  # a server-side copy, atomic per key, then the temporary's removal
        retry_storage(lambda: fs.copy(temp_path, path), "commit", uri, fs)
        _remove_quietly(fs, temp_path, uri)


def make_directory(fs: AbstractFileSystem, path: str, uri: str) -> None:
    """Create ``path`` on a local disk. Object stores have no directories, and s3fs's
    makedirs would create a missing bucket: a job must fail on one, not make it."""
    if isinstance(fs, LocalFileSystem):
        retry_storage(lambda: fs.makedirs(path, exist_ok=True), "write", uri, fs)


def _remove_quietly(fs: AbstractFileSystem, path: str, uri: str) -> None:
    """Delete ``path`` if it is there; a failure leaves a stray temporary, never an error."""
    try:
        retry_storage(lambda: fs.rm_file(path), "delete", uri, fs)
    except StorageError:
        pass  # gone already (committed by rename), or the store refuses: remove_stale_temporaries sweeps it


def remove_stale_temporaries(uri: str, storage_options: dict[str, Any] | None = None) -> int:
    """Delete temporary objects a killed run left for ``uri``; return how many."""
    fs, path = filesystem(uri, storage_options)
    directory, name = path.rsplit("/", 1)
    try:
        stale = cast("list[str]", retry_storage(lambda: fs.glob(f"{directory}/_tmp/{name}.*"), "list",
                                                f"{uri} temporaries", fs))
    except StorageNotFound:
        return 0
    for temp_path in stale:
        _remove_quietly(fs, temp_path, uri)
    return len(stale)


def exists(uri: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether an object is at ``uri`` (retried like every storage call)."""
    fs, path = filesystem(uri, storage_options)
    return retry_storage(lambda: fs.exists(path), "check", uri, fs)
