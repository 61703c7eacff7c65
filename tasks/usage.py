"""Usage accounting: tokens and request counts per shard, per job, and OpenAI's batch object.

Every manifest carries its shard's usage (``usage_fields``): rows (requests), errors
(failed requests), prompt, completion and cached prompt tokens (prompt tokens whose
keys and values the engine's prefix cache already held), and reasoning tokens (the
completion tokens the reasoning parser put in the reasoning), and collapsed rows (rows
whose output the engine copied from an identical row's computation, counted among
rows, their tokens billed as their own). The job summary sums the
manifests; at the end of a job ``<output>/_batch.json`` holds the same totals as an
OpenAI Batch object (``request_counts`` and ``usage``), whatever the output format.

Invariants: a shard's usage is the sum of its rows' (a failed row counts as a
request and costs no tokens; a row whose tool call the model botched counts as an
error and costs its tokens, as its Parquet row does), and the job's is the sum of its shards' manifests,
skipped shards included: a resumed job reports the whole job's usage.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from .executor import RowResult
from .job import BatchJob, JobTask, OutputFormat
from .rows import PreparedShard
from .storage import filesystem, join, write_atomic

BATCH_OBJECT = "_batch.json"
_TASK_ENDPOINTS = {JobTask.CHAT: "/v1/chat/completions", JobTask.GENERATE: "/v1/completions",
                   JobTask.EMBED: "/v1/embeddings"}
_KIND_ENDPOINTS = {"chat.completion": "/v1/chat/completions", "text_completion": "/v1/completions",
                   "embedding": "/v1/embeddings", "response": "/v1/responses"}


def usage_fields(prepared: PreparedShard, results: dict[int, RowResult], job: BatchJob) -> dict[str, Any]:
    """A shard's manifest fields for its usage: request counts, token counts, endpoints."""
    prompt = completion = cached = failed = reasoning = collapsed = 0
    for row in prepared.rows:
        found = [results.get(request.index) for request in row.engine_requests()]
        outputs = [result.output for result in found if result is not None and result.output is not None]
        if row.error is not None or not found or len(outputs) < len(found):
            failed += 1  # a request that failed, in whole or in part, is not billed
            continue
        collapsed += any(getattr(output, "duplicate_of", None) is not None for output in outputs)
        for output in outputs:
            prompt += len(output.prompt_token_ids)
            cached += getattr(output, "num_cached_tokens", 0)
            if isinstance(output.outputs, list):  # an embedding's prompt is all it costs
                completion += sum(len(sample.token_ids) for sample in output.outputs)
                reasoning += sum(sample.num_reasoning_tokens for sample in output.outputs)
        failed += any(sample.tool_calls is not None and sample.tool_calls.error is not None
                      for output in outputs if isinstance(output.outputs, list) for sample in output.outputs)
    kinds = {kind for row in prepared.rows if (kind := getattr(row, "kind", None)) is not None}
    endpoints = sorted(_KIND_ENDPOINTS[kind] for kind in kinds) if kinds else [_TASK_ENDPOINTS[job.task]]
    return {"rows": len(prepared.rows), "errors": failed, "prompt_tokens": prompt, "completion_tokens": completion,
            "cached_prompt_tokens": cached, "endpoints": endpoints, "reasoning_tokens": reasoning,
            "collapsed_rows": collapsed}


def batch_object(job: BatchJob, summary: dict[str, Any], created_at: float) -> dict[str, Any]:
    """The job as an OpenAI Batch object (openai.types.Batch): its request counts, token usage,
    and one error per failed shard; ``shard_counts`` says how many shards were done,
    skipped or failed."""
    from .errors import redact_url

    entries, totals = summary["shards"], summary["totals"]
    failed_shards = [entry for entry in entries if entry["status"] == "failed"]
    endpoints = sorted({url for entry in entries for url in entry.get("endpoints") or []})
    prompt, completion = totals["prompt_tokens"], totals["completion_tokens"]
    now = int(time.time())
    output = redact_url(job.output)
    return {
        "id": "batch_" + hashlib.sha256(output.encode()).hexdigest()[:24],
        "object": "batch",
        "endpoint": ", ".join(endpoints) or _TASK_ENDPOINTS[job.task],
        "model": job.served_model_name or job.model,
        "input_file_id": redact_url(job.input),
        "output_file_id": output,
        "error_file_id": join(output, "*.errors.jsonl") if job.output_format == OutputFormat.OPENAI else None,
        "completion_window": "24h",
        "status": "failed" if failed_shards else "completed",
        "created_at": int(created_at),
        "in_progress_at": int(created_at),
        **({"failed_at": now} if failed_shards else {"completed_at": now}),
        "errors": {"object": "list", "data": [{"code": "shard_failed", "message": entry["message"],
                                               "param": entry["shard"], "line": None} for entry in failed_shards]}
        if failed_shards else None,
        "request_counts": {"total": totals["rows"], "completed": totals["rows"] - totals["errors"],
                           "failed": totals["errors"]},
        "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": totals["cached_prompt_tokens"]},
                  "output_tokens": completion,  # reasoning tokens included, and counted apart
                  "output_tokens_details": {"reasoning_tokens": totals.get("reasoning_tokens", 0)},
                  "total_tokens": prompt + completion},
        "shard_counts": {name: totals[name] for name in ("shards", "done", "skipped", "failed")},
        # Rows whose output was copied from an identical row's computation (shardline's).
        "collapsed_rows": totals.get("collapsed_rows", 0),
    }


def write_batch_object(job: BatchJob, summary: dict[str, Any], created_at: float) -> dict[str, Any]:
    """Write the job's batch object to ``<output>/_batch.json`` (atomically); return it."""
    fs, path = filesystem(job.output, job.storage())
    batch = batch_object(job, summary, created_at)
    write_atomic(fs.unstrip_protocol(join(path, BATCH_OBJECT)), json.dumps(batch, indent=2).encode(), job.storage())
    return batch
