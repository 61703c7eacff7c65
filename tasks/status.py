"""How far a job over an output prefix got: ``shardline status OUTPUT``.

Read from what the job leaves in storage, so it works for a job still running, one
that finished and one that was killed: the manifests (``_manifests/<key>.json``, a
shard's commit marker, with its counts and timings), the job record a run writes
before its first shard (``_job.json``: the input's shards, so the ones not committed
yet show as missing) and the batch object a run writes at its end (``_batch.json``:
which shards failed). Nothing here runs or changes anything.

A shard is ``done`` when its manifest is there, ``failed`` when the run that wrote
the job record ended with it failed and no manifest, else ``missing`` (not run yet,
running, or stopped). A manifest that is unreadable is reported as such, never skipped.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, cast

from .errors import StorageError, StorageNotFound, redact_url
from .job import BatchJob
from .manifest import ManifestError, ShardManifest
from .storage import Shard, filesystem, join, retry_storage, write_atomic
from .usage import BATCH_OBJECT

JOB_RECORD = "_job.json"
MANIFESTS = "_manifests"
_TOTALS = ("rows", "errors", "prompt_tokens", "completion_tokens", "seconds")


@dataclass
class ShardStatus:
    """One shard of the output: done (with its manifest's counts), failed or missing."""

    shard: str
    status: str  # done, failed, missing
    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    written_at: str | None = None
    message: str | None = None


@dataclass
class OutputStatus:
    """Every shard the output knows of, totals, and the state of the job that wrote it."""

    output: str
    state: str  # finished, unfinished (running, or stopped before its end), unknown (no job record)
    input: str | None
    model: str | None
    started_at: str | None
    shards: list[ShardStatus] = field(default_factory=list)

    def totals(self) -> dict[str, Any]:
        counts = {name: sum(shard.status == name for shard in self.shards) for name in ("done", "failed", "missing")}
        sums = {name: sum(getattr(shard, name) for shard in self.shards) for name in _TOTALS}
        sums["seconds"] = round(sums["seconds"], 3)
        return {"shards": len(self.shards), **counts, **sums}

    def as_json(self) -> dict[str, Any]:
        return {"output": self.output, "state": self.state, "input": self.input, "model": self.model,
                "started_at": self.started_at, "totals": self.totals(), "shards": [asdict(s) for s in self.shards]}


def write_job_record(job: BatchJob, shards: list[Shard], created_at: float) -> None:
    """Write ``<output>/_job.json``: the job's input shards, model and start (no credentials).
    ``created_at`` is the run's start, as its batch object will carry it."""
    record = {"input": redact_url(job.input), "output": redact_url(job.output), "model": job.model,
              "created_at": int(created_at),
              "started_at": datetime.fromtimestamp(created_at, timezone.utc).isoformat(),
              "shards": [{"key": shard.key, "input": redact_url(shard.uri), "size": shard.size} for shard in shards]}
    fs, path = filesystem(job.output, job.storage())
    write_atomic(fs.unstrip_protocol(join(path, JOB_RECORD)), json.dumps(record, indent=2).encode(), job.storage())


def output_status(output: str, storage_options: dict[str, Any] | None = None) -> OutputStatus:
    """The status of every shard under ``output``; StorageNotFound when the prefix holds
    no manifest, job record or batch object (not a shardline output)."""
    fs, path = filesystem(output, storage_options)
    record = _read_json(fs, join(path, JOB_RECORD), output)
    batch = _read_json(fs, join(path, BATCH_OBJECT), output)
    manifests = _read_manifests(fs, join(path, MANIFESTS), output)
    if record is None and batch is None and not manifests:
        raise StorageNotFound("status", redact_url(output), f"no {MANIFESTS}/, {JOB_RECORD} or {BATCH_OBJECT} there: "
                              "not the output prefix of a shardline job (or nothing committed yet)")
    finished = record is not None and batch is not None and batch.get("created_at") == record.get("created_at")
    failed = {error.get("param"): error.get("message") for error in ((batch or {}).get("errors") or {}).get("data", [])
              if record is None or finished}
    keys = [entry["key"] for entry in (record or {}).get("shards", [])]
    keys += sorted(set(manifests) - set(keys)) + sorted(set(failed) - set(manifests) - set(keys))
    shards = [_shard_status(key, manifests.get(key), failed) for key in keys]
    state = "unknown" if record is None else "finished" if finished else "unfinished"
    return OutputStatus(redact_url(output), state, (record or {}).get("input"), (record or {}).get("model"),
                        (record or {}).get("started_at"), shards)


def _shard_status(key: str, manifest: ShardManifest | str | None, failed: dict[str | None, Any]) -> ShardStatus:
    if isinstance(manifest, ShardManifest):
        return ShardStatus(key, "done", manifest.rows, manifest.errors, manifest.prompt_tokens,
                           manifest.completion_tokens, round(sum(manifest.seconds.values()), 3), manifest.written_at)
    if isinstance(manifest, str):  # unreadable: say so, a rerun redoes the shard
        return ShardStatus(key, "failed", message=manifest)
    if key in failed:
        return ShardStatus(key, "failed", message=str(failed[key]))
    return ShardStatus(key, "missing")


def _read_json(fs: Any, path: str, output: str) -> dict[str, Any] | None:
    try:
        data = retry_storage(lambda: fs.cat_file(path), "read", redact_url(output), fs)
    except StorageNotFound:
        return None
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StorageError("read", redact_url(path), f"not JSON: {exc}") from exc
    return value if isinstance(value, dict) else None


def _read_manifests(fs: Any, directory: str, output: str) -> dict[str, ShardManifest | str]:
    """Shard key -> its manifest, or why it cannot be read."""
    try:
        paths = cast("list[str]", retry_storage(lambda: fs.find(directory), "list", redact_url(output), fs))
    except StorageNotFound:
        return {}
    prefix = directory.rstrip("/") + "/"
    paths = [p for p in paths if p.endswith(".json") and "/_tmp/" not in p[len(prefix) - 1:]]
    contents = retry_storage(lambda: fs.cat(paths), "read", redact_url(output), fs) if paths else {}
    manifests: dict[str, ShardManifest | str] = {}
    for path, data in sorted(cast("dict[str, bytes]", contents).items()):
        key = path[path.index(prefix) + len(prefix):-len(".json")] if prefix in path else path
        try:
            manifests[key] = ShardManifest.from_json(json.loads(data))
        except (json.JSONDecodeError, UnicodeDecodeError, ManifestError) as exc:
            manifests[key] = f"manifest {MANIFESTS}/{key}.json cannot be read ({exc}); a rerun redoes the shard"
    return manifests


def status_table(status: OutputStatus) -> str:
    """The status as a plain-text table with a totals line (what ``shardline status`` prints)."""
    header = ["shard", "status", *_TOTALS, "written_at"]
    rows = [[shard.shard, shard.status, *(str(getattr(shard, name)) for name in _TOTALS), shard.written_at or ""]
            for shard in status.shards]
    totals = status.totals()
    rows.append(["TOTAL", f"{totals['done']} done/{totals['failed']} failed/{totals['missing']} missing",
                 *(str(totals[name]) for name in _TOTALS), ""])
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()
             for cells in [header, ["-" * w for w in widths], *rows]]
    lines += [f"failed {shard.shard}: {shard.message}" for shard in status.shards if shard.message]
    job = {"finished": "finished", "unfinished": "not finished (running, or stopped before its end)",
           "unknown": f"unknown (no {JOB_RECORD}: shards not committed yet cannot be listed)"}[status.state]
    lines.append(f"job: {job}; output: {status.output}" + (f"; input: {status.input}" if status.input else "")
                 + (f"; started {status.started_at}" if status.started_at else ""))
    return "\n".join(lines)
