"""OpenAI Batch API output: one response line per request line, in input order.

``<output>/<key>.jsonl`` holds a line per input row,
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``,
whose body is a chat.completion, text_completion, embedding list or (for
/v1/responses lines) response object as the OpenAI API returns it (usage, with
reasoning tokens, included; logprobs when asked; tool calls as ``tool_calls`` or
function_call items, tasks/responses_output.py). ``<key>.errors.jsonl``
holds the failed rows' lines again, as OpenAI's error file does (empty when none
failed, so a rerun never leaves an earlier run's errors beside a new output).

A failed row's line has an ``error`` ``{"code", "message"}``; a request the job
refused (a bad field, another model) also has a 400 response whose body carries
OpenAI's error object, while a line that was no request (not JSON, no custom_id)
and a row the engine failed have ``response: null``. A row whose tool call the model
botched keeps its response (the text as content) and has an ``invalid_tool_call``
error beside it. Rows of Parquet or plain
JSON Lines input get the response of the job's task, their ``id`` as custom_id.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any

import numpy as np

from .executor import RowResult
from .job import BatchJob, JobTask
from .openai_requests import CHAT, COMPLETION, EMBEDDING, RESPONSE, OpenAIRow
from .responses_output import response_object
from .rows import PreparedRow, PreparedShard

_TASK_KINDS = {JobTask.CHAT: CHAT, JobTask.GENERATE: COMPLETION, JobTask.EMBED: EMBEDDING}


def openai_lines(prepared: PreparedShard, results: dict[int, RowResult], job: BatchJob) -> tuple[bytes, bytes]:
    """The output file and the error file of one shard, as JSON Lines bytes."""
    created = int(time.time())
    lines, error_lines = [], []
    for row in prepared.rows:
        row = row if isinstance(row, OpenAIRow) else _as_openai_row(row, job)
        line = _line(row, [results.get(request.index) for request in row.engine_requests()], created)
        text = json.dumps(line, ensure_ascii=False, separators=(",", ":"))
        lines.append(text)
        if line["error"] is not None:
            error_lines.append(text)
    return _joined(lines), _joined(error_lines)


def _joined(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


def _as_openai_row(row: PreparedRow, job: BatchJob) -> OpenAIRow:
    """A row of Parquet or plain JSON Lines input, answered as the job's task's endpoint."""
    return OpenAIRow(row.index, row.id, row.request, row.error, custom_id=row.id, kind=_TASK_KINDS[job.task],
                     model_name=job.served_model_name or job.model,
                     error_code=None if row.error is None else "invalid_request",
                     status_code=None if row.error is None else 400)


def _line(row: OpenAIRow, results: list[RowResult | None], created: int) -> dict[str, Any]:
    line: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": row.custom_id,
                            "response": None, "error": None}
    if row.error is not None:
        line["error"] = {"code": row.error_code or "invalid_request", "message": row.error}
        if row.status_code is not None:
            line["response"] = {"status_code": row.status_code, "request_id": _request_id(), "body": {"error": {
                "message": row.error, "type": "invalid_request_error", "param": row.param,
                "code": row.error_code}}}
        return line
    outputs = [result.output for result in results if result is not None and result.output is not None]
    if not results or len(outputs) < len(results):
        failed = next((result for result in results if result is None or result.output is None), None)
        message = "internal error: the row never came back from the engine" if failed is None else failed.error
        line["error"] = {"code": "request_failed", "message": message}
    else:
        body = response_body(row, outputs, created)
        line["response"] = {"status_code": 200, "request_id": _request_id(), "body": body}
        botched = [sample.tool_calls.error for output in outputs if isinstance(output.outputs, list)
                   for sample in output.outputs if sample.tool_calls is not None and sample.tool_calls.error]
        if botched:
            line["error"] = {"code": "invalid_tool_call", "message": botched[0]}
    return line


def _request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def response_body(row: OpenAIRow, outputs: list[Any], created: int) -> dict[str, Any]:
    """The API's response object for one finished row (``outputs``: one per prompt of the line)."""
    if row.kind == EMBEDDING:
        return _embedding_body(row, outputs)
    if row.kind == RESPONSE:
        return response_object(row, outputs[0], created)
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    samples = [sample for output in outputs for sample in output.outputs]
    completion_tokens = sum(len(sample.token_ids) for sample in samples)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens,
             "prompt_tokens_details": {"cached_tokens": sum(output.num_cached_tokens for output in outputs)},
             "completion_tokens_details": {"reasoning_tokens": sum(s.num_reasoning_tokens for s in samples)}}
    if row.kind == CHAT:
        choices = [_chat_choice(row, sample) for sample in outputs[0].outputs]
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": CHAT, "created": created, "model": row.model_name,
                "choices": choices, "usage": usage}
    # Several prompts: their choices in prompt order, n each, indexed as the API does.
    choices = [{"index": number * len(output.outputs) + sample.index, "text": sample.text,
                "finish_reason": sample.finish_reason,
                "logprobs": None if row.logprobs is None else _completion_logprobs(sample, row.logprobs)}
               for number, output in enumerate(outputs) for sample in output.outputs]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": COMPLETION, "created": created, "model": row.model_name,
            "choices": choices, "usage": usage}


def _chat_choice(row: OpenAIRow, sample: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": sample.text}
    finish_reason = sample.finish_reason
    calls = sample.tool_calls
    if calls is not None and calls.calls:
        message["content"], message["tool_calls"] = calls.content, [call.to_openai() for call in calls.calls]
        # OpenAI answers a named tool_choice with "stop", a call the model chose with "tool_calls".
        if row.tool_mode != "named" and finish_reason == "stop":
            finish_reason = "tool_calls"
    if sample.reasoning is not None:
        message["reasoning_content"] = sample.reasoning
    logprobs = None if row.logprobs is None else {"content": _chat_logprobs(sample, row.logprobs), "refusal": None}
    return {"index": sample.index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}


def _positions(sample: Any, top: int) -> list[tuple[Any, list[Any]]]:
    """Each generated position's sampled Logprob and its ``top`` most likely, by rank."""
    positions = []
    for token_id, candidates in zip(sample.token_ids, sample.logprobs or []):
        ranked = sorted((lp for lp in candidates.values() if lp.rank is not None and lp.rank <= top),
                        key=lambda lp: lp.rank)
        positions.append((candidates[token_id], ranked))
    return positions


def _chat_logprobs(sample: Any, top: int) -> list[dict[str, Any]]:
    def entry(logprob: Any) -> dict[str, Any]:
        token = logprob.decoded_token or ""
        return {"token": token, "logprob": logprob.logprob, "bytes": list(token.encode())}

    return [{**entry(chosen), "top_logprobs": [entry(lp) for lp in ranked]}
            for chosen, ranked in _positions(sample, top)]


def _completion_logprobs(sample: Any, top: int) -> dict[str, Any]:
    positions = _positions(sample, top)
    tokens = [chosen.decoded_token or "" for chosen, _ in positions]
    offsets = np.cumsum([0] + [len(token) for token in tokens[:-1]]).tolist() if tokens else []
    return {"tokens": tokens, "token_logprobs": [chosen.logprob for chosen, _ in positions],
            "top_logprobs": [{lp.decoded_token or "": lp.logprob for lp in ranked} for _, ranked in positions],
            "text_offset": offsets}


def _embedding_body(row: OpenAIRow, outputs: list[Any]) -> dict[str, Any]:
    def encoded(vector: list[float]) -> list[float] | str:
        if row.encoding_format == "base64":
            return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        return list(vector)

    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"object": "list", "model": row.model_name,
            "data": [{"object": "embedding", "index": number, "embedding": encoded(output.outputs.embedding)}
                     for number, output in enumerate(outputs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
