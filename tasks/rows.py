"""Validating rows and turning them into engine requests.

A row has ``prompt`` (generate, embed) or ``messages`` (chat), an optional ``id``
(else ``<shard key>:<row>``) and optional per-row overrides: max_tokens,
temperature, top_p, seed, priority, lora, and a structured-output constraint
(``response_format`` or ``json_schema``, tasks/structured_rows.py); a chat row may offer
``tools`` with a ``tool_choice`` (tasks/openai_tools.py). A row that cannot run gets an error that
names what is wrong; its shard goes on. A shard without the column its task needs
fails as a whole (ShardError).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shardline import LoRARequest, PoolingParams, SamplingParams

from .executor import RowRequest
from .job import BatchJob, JobTask
from .media import chat_images, column_images
from .openai_tools import row_tools
from .shard_reader import RawShard, RecordProblem, ShardError
from .structured_rows import RowConstraints

SAMPLING_OVERRIDES = ("max_tokens", "temperature", "top_p", "seed")
_INT_OVERRIDES = ("max_tokens", "seed", "priority")


@dataclass
class PreparedRow:
    """One input row: its id and either an engine request or the reason it cannot run."""

    index: int
    id: str
    request: RowRequest | None
    error: str | None = None

    def engine_requests(self) -> list[RowRequest]:
        """What the row asks of the engine (an OpenAI request line may ask several prompts)."""
        return [] if self.request is None else [self.request]


@dataclass
class PreparedShard:
    """A validated shard: one PreparedRow per input row, in input order."""

    raw: RawShard
    rows: list[PreparedRow]
    read_seconds: float = 0.0

    @property
    def key(self) -> str:
        return self.raw.shard.key


def prepare_shard(raw: RawShard, job: BatchJob) -> PreparedShard:
    """Validate every row of ``raw`` for ``job``; bad rows carry their error."""
    _check_columns(raw, job)
    lora_ids = {name: number for number, name in enumerate(sorted(job.lora_adapters), start=1)}
    constraints = RowConstraints(job)
    rows = []
    for index, record in enumerate(raw.records):
        row_id = _row_id(raw, index, record)
        try:
            if isinstance(record, RecordProblem):
                raise ValueError(record.message)
            request = _row_request(index, record, job, lora_ids, constraints)
            rows.append(PreparedRow(index, row_id, request))
        except ValueError as exc:
            rows.append(PreparedRow(index, row_id, None, str(exc)))
    return PreparedShard(raw, rows)


def _check_columns(raw: RawShard, job: BatchJob) -> None:
    needed = "messages" if job.task == JobTask.CHAT else "prompt"
    columns = sorted(raw.schema)
    if raw.records and needed not in raw.schema:
        raise ShardError(raw.shard.uri, f"no {needed!r} column, which task={job.task.value} needs "
                                        f"(columns: {', '.join(columns) or 'none'})")
    image_column = job.images.column
    if raw.records and image_column is not None and image_column not in raw.schema:
        raise ShardError(raw.shard.uri, f"no {image_column!r} column, which images.column names "
                                        f"(columns: {', '.join(columns) or 'none'})")
    missing = [name for name in job.pass_through if name not in raw.schema]
    if raw.records and missing:
        raise ShardError(raw.shard.uri, f"pass-through column(s) {', '.join(map(repr, missing))} not in the "
                                        f"shard (columns: {', '.join(columns) or 'none'})")


def _row_id(raw: RawShard, index: int, record: Any) -> str:
    value = record.get("id") if isinstance(record, dict) else None
    return f"{raw.shard.key}:{index}" if value is None else str(value)


def _row_request(index: int, record: dict[str, Any], job: BatchJob, lora_ids: dict[str, int],
                 constraints: RowConstraints) -> RowRequest:
    overrides = {name: _override(record, name) for name in (*SAMPLING_OVERRIDES, "priority", "lora")}
    priority = overrides.pop("priority")
    lora_name = overrides.pop("lora")
    if job.task != JobTask.EMBED:
        overrides["structured_outputs"] = constraints.of(record)
    chat_options = None
    if job.task == JobTask.CHAT and record.get("tools") is not None:
        overrides["structured_outputs"], overrides["tool_choice"], chat_options = row_tools(
            record, overrides["structured_outputs"])
    images = column_images(record.get(job.images.column), job.images) if job.images.column else []
    if job.task == JobTask.CHAT:
        prompt = None
        messages, images = chat_images(_messages(record.get("messages")), images, job.images)
    else:
        prompt, messages = _prompt(record.get("prompt")), None
    return RowRequest(
        index=index,
        prompt=prompt,
        messages=messages,
        params=_params(job, overrides),
        lora_request=_lora(lora_name, job, lora_ids),
        priority=0 if priority is None else priority,
        images=images or None,
        chat_options=chat_options,
    )


def _override(record: dict[str, Any], name: str) -> Any:
    value = record.get(name)
    if name in _INT_OVERRIDES and isinstance(value, float) and value.is_integer():
        return int(value)  # JSON and pandas turn 64 into 64.0 easily
    if name in _INT_OVERRIDES and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if name == "lora" and value is not None and not isinstance(value, str):
        raise ValueError(f"lora must be an adapter name (a string), got {value!r}")
    return value


def _prompt(value: Any) -> str:
    if value is None:
        raise ValueError("the row has no prompt (null or missing)")
    if not isinstance(value, str):
        raise ValueError(f"prompt must be a string, got {type(value).__name__} {value!r:.80}")
    if not value.strip():
        raise ValueError("the prompt is empty")
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"malformed messages: a string that is not JSON ({exc.msg})") from exc
    if value is None:
        raise ValueError("the row has no messages (null or missing)")
    if not isinstance(value, list) or not value:
        raise ValueError(f"malformed messages: expected a non-empty list of {{role, content}} objects, "
                         f"got {value!r:.80}")
    for position, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not _is_content(message.get("content")):
            raise ValueError(f"malformed messages: message {position} must be an object with a string 'role' "
                             f"and a 'content' string or list of text and image_url parts, got {message!r:.80}")
    return [dict(message) for message in value]


def _is_content(content: Any) -> bool:
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict) and (part.get("type") in ("image_url", "image")
                                    or (part.get("type") == "text" and isinstance(part.get("text"), str)))
        for part in content)


def _params(job: BatchJob, overrides: dict[str, Any]) -> SamplingParams | PoolingParams:
    if job.task == JobTask.EMBED:
        return PoolingParams(normalize=job.pooling.normalize, dimensions=job.pooling.dimensions)
    values = job.sampling.model_dump()
    values.update({name: value for name, value in overrides.items() if value is not None})
    return SamplingParams(**values)


def _lora(name: str | None, job: BatchJob, lora_ids: dict[str, int]) -> LoRARequest | None:
    if name is None or name == "":
        return None
    if name not in job.lora_adapters:
        known = ", ".join(sorted(job.lora_adapters)) or "none configured"
        raise ValueError(f"unknown LoRA adapter {name!r}; known adapters: {known} (set lora_adapters in the job)")
    return LoRARequest(name, lora_ids[name], job.lora_adapters[name])
