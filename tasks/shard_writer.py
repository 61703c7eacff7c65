"""Writing a shard's output and manifest, and deciding whether a shard is done.

Output: ``<output>/<key>.parquet``, exactly one row per input row in input order, or
with output_format openai ``<key>.jsonl`` and ``<key>.errors.jsonl`` (tasks/openai_responses.py).
A Parquet output of OpenAI chat or Responses requests, or of chat rows with a ``tools``
column, has a ``tool_calls`` column: the
JSON text of the calls the engine read (OpenAI's ``tool_calls`` entries; a list per
sample when n > 1), null for a row that called none; a call the model botched is the
row's error, its text kept.
Manifest: ``<output>/_manifests/<key>.json``. Both are written atomically
(storage.write_atomic), the manifest last: the manifest is the commit marker, so a
shard with a manifest whose fingerprint matches the job is complete.
"""

from __future__ import annotations

import io
import json
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, cast

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import redact_url
from .executor import RowResult
from .fingerprint import fingerprint, fingerprint_fields
from .job import BatchJob, JobTask, OutputFormat
from .manifest import ManifestError, ShardManifest
from .openai_requests import CHAT, RESPONSE
from .openai_responses import openai_lines
from .rows import PreparedShard
from .shard_reader import ShardError, read_input_schema
from .storage import Shard, exists, filesystem, join, remove_stale_temporaries, retry_storage, write_atomic
from .structured_rows import check_outputs, count_invalid_outputs
from .usage import usage_fields

if TYPE_CHECKING:
    from shardline.engine.outputs import EmbeddingRequestOutput


def output_uri(job: BatchJob, shard: Shard) -> str:
    """Where ``shard``'s output goes, as a full URL (``file://`` for local paths)."""
    fs, path = filesystem(job.output, job.storage())
    suffix = ".jsonl" if job.output_format == OutputFormat.OPENAI else ".parquet"
    return fs.unstrip_protocol(join(path, f"{shard.key}{suffix}"))


def errors_uri(job: BatchJob, shard: Shard) -> str:
    """Where an OpenAI-format output's error file goes: ``<output>/<key>.errors.jsonl``."""
    fs, path = filesystem(job.output, job.storage())
    return fs.unstrip_protocol(join(path, f"{shard.key}.errors.jsonl"))


def manifest_uri(job: BatchJob, shard: Shard) -> str:
    fs, path = filesystem(job.output, job.storage())
    return fs.unstrip_protocol(join(path, "_manifests", f"{shard.key}.json"))


def build_output_table(prepared: PreparedShard, results: dict[int, RowResult], job: BatchJob) -> pa.Table:
    """The output table: one row per input row, in input order."""
    columns: dict[str, pa.Array] = {"id": pa.array([row.id for row in prepared.rows], pa.string())}
    outputs = [results[row.index].output if row.index in results else None for row in prepared.rows]
    if job.task == JobTask.EMBED:
        columns["embedding"] = pa.array(
            [None if o is None else list(cast("EmbeddingRequestOutput", o).outputs.embedding) for o in outputs],
            pa.list_(pa.float32()))  # an embed job's rows all get embeddings
        columns["prompt_tokens"] = _ints([None if o is None else len(o.prompt_token_ids) for o in outputs])
    else:
        columns.update(_completion_columns(outputs, job.sampling.n))
    checked = check_outputs(prepared.rows, outputs, job, prepared.raw.schema)  # parsed, reasoning
    columns.update(checked.columns)
    tool_errors: dict[int, str] = {}
    if "tools" in prepared.raw.schema or any(getattr(row, "kind", None) in (CHAT, RESPONSE) for row in prepared.rows):
        columns["tool_calls"], tool_errors = _tool_calls_column(prepared, outputs, job.sampling.n)
    columns["error"] = pa.array([_row_error(row, results) or checked.errors.get(row.index)
                                 or tool_errors.get(row.index) for row in prepared.rows], pa.string())
    for name in job.pass_through:
        columns[name] = prepared.raw.pass_through_array(name)
    return pa.table(columns)


def _completion_columns(outputs: list[Any], n: int) -> dict[str, pa.Array]:
    texts = [None if o is None else [c.text for c in o.outputs] for o in outputs]
    reasons = [None if o is None else [c.finish_reason for c in o.outputs] for o in outputs]
    columns: dict[str, pa.Array] = {}
    if n == 1:
        columns["text"] = pa.array([None if t is None else t[0] for t in texts], pa.string())
        columns["finish_reason"] = pa.array([None if r is None else r[0] for r in reasons], pa.string())
    else:
        columns["texts"] = pa.array(texts, pa.list_(pa.string()))
        columns["finish_reason"] = pa.array(reasons, pa.list_(pa.string()))
    columns["prompt_tokens"] = _ints([None if o is None else len(o.prompt_token_ids) for o in outputs])
    columns["completion_tokens"] = _ints(
        [None if o is None else sum(len(c.token_ids) for c in o.outputs) for o in outputs])
    return columns


def _tool_calls_column(prepared: PreparedShard, outputs: list[Any], n: int) -> tuple[pa.Array, dict[int, str]]:
    """The ``tool_calls`` column (JSON text) and the rows whose calls could not be read."""
    texts: list[str | None] = []
    errors: dict[int, str] = {}
    for row, output in zip(prepared.rows, outputs):
        samples = [] if output is None else [sample.tool_calls for sample in output.outputs]
        for read in samples:
            if read is not None and read.error is not None:
                errors.setdefault(row.index, read.error)
        calls = [[call.to_openai() for call in read.calls] if read is not None else [] for read in samples]
        if not any(calls):
            texts.append(None)
        else:
            texts.append(json.dumps(calls[0] if n == 1 else calls, ensure_ascii=False))
    return pa.array(texts, pa.string()), errors


def _ints(values: list[int | None]) -> pa.Array:
    return pa.array(values, pa.int64())


def _row_error(row: Any, results: dict[int, RowResult]) -> str | None:
    if row.error is not None:
        return row.error
    result = results.get(row.index)
    if result is None:
        return "internal error: the row never came back from the engine"
    return result.error


def write_shard_output(
    prepared: PreparedShard, results: dict[int, RowResult], job: BatchJob, seconds: dict[str, float]
) -> ShardManifest:
    """Write the output shard, then its manifest (the commit marker); return the manifest."""
    shard = prepared.raw.shard
    storage_options = job.storage()
    counts = usage_fields(prepared, results, job)  # requests and tokens (tasks/usage.py)
    if job.output_format == OutputFormat.OPENAI:
        output, errors = openai_lines(prepared, results, job)
        files = {errors_uri(job, shard): errors, output_uri(job, shard): output}
    else:
        table = build_output_table(prepared, results, job)
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        files = {output_uri(job, shard): buffer.getvalue()}
        counts.update(_table_counts(table))
    started = time.perf_counter()
    for uri in (*files, manifest_uri(job, shard)):
        remove_stale_temporaries(uri, storage_options)
    for uri, data in files.items():  # the output shard last: only the manifest comes after it
        write_atomic(uri, data, storage_options)
    fields = fingerprint_fields(job, shard, prepared.raw.schema)
    manifest = ShardManifest(
        shard=shard.key, input=redact_url(shard.uri), output=redact_url(output_uri(job, shard)),
        rows=counts["rows"], errors=counts["errors"], prompt_tokens=counts["prompt_tokens"],
        completion_tokens=counts["completion_tokens"], cached_prompt_tokens=counts["cached_prompt_tokens"],
        endpoints=tuple(counts["endpoints"]), invalid_outputs=counts.get("invalid_outputs"),
        reasoning_tokens=counts["reasoning_tokens"], collapsed_rows=counts["collapsed_rows"],
        seconds={**seconds, "write": round(time.perf_counter() - started, 4)},
        written_at=datetime.now(timezone.utc).isoformat(), fingerprint=fingerprint(fields), job=fields,
    )
    write_atomic(manifest_uri(job, shard), json.dumps(manifest.to_json(), indent=2).encode(), storage_options)
    return manifest


def _table_counts(table: pa.Table) -> dict[str, int]:
    return {
        "rows": table.num_rows,
        "errors": table.num_rows - table.column("error").null_count,
        "invalid_outputs": count_invalid_outputs(table),  # structured outputs that did not validate
        "prompt_tokens": _column_sum(table, "prompt_tokens"),
        "completion_tokens": _column_sum(table, "completion_tokens"),
    }


def _column_sum(table: pa.Table, name: str) -> int:
    if name not in table.column_names:
        return 0
    return int(sum(value for value in table.column(name).to_pylist() if value is not None))


def read_manifest(job: BatchJob, shard: Shard) -> ShardManifest | None:
    """The shard's manifest, or None when there is none (or it is unreadable)."""
    fs, path = filesystem(manifest_uri(job, shard), job.storage())
    try:
        data = json.loads(retry_storage(lambda: fs.cat_file(path), "read", manifest_uri(job, shard), fs))
        return ShardManifest.from_json(data)
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError, ManifestError):
        return None  # never happens to a committed manifest; redo the shard


def completed_manifest(shard: Shard, job: BatchJob) -> ShardManifest | None:
    """The manifest of ``shard`` if it is already done for ``job`` (same fingerprint
    and its output present), else None. Does no engine work."""
    manifest = read_manifest(job, shard)
    if manifest is None:
        return None
    try:
        schema = read_input_schema(shard, job.storage())
    except ShardError:
        return None  # let the run report why the shard cannot be read
    if manifest.fingerprint != fingerprint(fingerprint_fields(job, shard, schema)):
        return None
    return manifest if exists(output_uri(job, shard), job.storage()) else None


def shard_is_done(shard: Shard, job: BatchJob) -> bool:
    """Whether ``shard``'s committed output matches ``job``'s fingerprint."""
    return completed_manifest(shard, job) is not None
