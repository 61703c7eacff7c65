"""What the shard pipeline hands an engine host, and what it gets back.

The pipeline (tasks/shard_job.py) turns a shard into RowRequests, gives them to a
ShardExecutor under the shard's key and writes the RowResults. It never sees
which process runs the engine. Two hosts implement ShardExecutor:

- ``ShardRunner`` (tasks/runner.py): this process's engine, driven by one thread;
- ``ServiceClient`` (tasks/engine_client.py): the host's shared engine service,
  a process of its own that runs the shards of many processes (Airflow).

Both are picked and cached by tasks/engine_cache.py (``EngineHost``).

Invariants every ShardExecutor keeps:
- ``run_shard`` returns one RowResult per RowRequest, in the order given; a row the
  engine refuses or that fails alone is a RowResult with ``error``, never a raise.
- It raises ShardAborted when ``abort_shard`` (or ``abort_all``) stopped the shard:
  its rows left the engine and no results come back; other shards go on.
- It raises RunnerError when the host itself failed, not a row (every waiting shard
  gets it), and after ``close``.
- ``abort_shard`` and ``abort_all`` may be called from any thread or a signal
  handler: they take only reentrant locks.
- RowRequest, RowResult, RowDone and EngineReading pickle (they cross the service's socket).
- ``on_row`` hears of each row that finishes once, before ``run_shard`` returns or
  raises; a failing ``on_row`` never fails the shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # the engine's public types, for annotations only
    from shardline import EmbeddingRequestOutput, LoRARequest, PoolingParams, RequestOutput, SamplingParams
    from shardline.engine.outputs import EngineStats

    from .media import ImageSource

logger = logging.getLogger("shardline.tasks.executor")


@dataclass
class RowRequest:
    """One row ready for the engine: a prompt or a chat, and its own parameters."""

    index: int  # the row's position in its shard
    prompt: str | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams | PoolingParams
    lora_request: LoRARequest | None = None
    priority: int = 0
    chat_options: dict[str, Any] | None = None  # LLM.render_chat keywords (tools, chat_template_kwargs, ...)
    # Images still to read (tasks/image_feed.py resolves them before the engine sees the row) ...
    images: list[ImageSource] | None = None
    # ... and, once read, a prompt's decoded images (vLLM's multi_modal_data); a chat's are image_pil parts.
    multi_modal_data: dict[str, Any] | None = None


@dataclass
class RowResult:
    """What became of one row: the engine's final output, or why it failed."""

    index: int
    output: RequestOutput | EmbeddingRequestOutput | None = None
    error: str | None = None


@dataclass(frozen=True)
class RowDone:
    """A row's engine request finished (progress reports; the RowResult comes with the shard)."""

    index: int
    completion_tokens: int
    failed: bool


# on_row(done): told as each request of a shard finishes, on the executor's driver thread;
# must be quick and must not raise (report_row logs what it raises and goes on).
RowCallback = Callable[[RowDone], None]


@dataclass(frozen=True)
class EngineReading:
    """An engine host's load as last seen by its driver: the engine's own counts and the
    seconds the driver has waited with nothing to run (since it started), read at
    ``at`` (time.monotonic()). Two readings give the share of time the engine was starved."""

    stats: EngineStats
    idle_seconds: float
    at: float


def row_done(result: RowResult) -> RowDone:
    """What a progress report says of a finished row."""
    completions = getattr(result.output, "outputs", None)
    tokens = sum(len(sample.token_ids) for sample in completions) if isinstance(completions, list) else 0
    return RowDone(result.index, tokens, result.error is not None)


def report_row(on_row: RowCallback, done: RowDone) -> None:
    """Call ``on_row``; a failing report is logged, never raised into the engine loop."""
    try:
        on_row(done)
    except Exception:
        logger.warning("a progress report failed (the row itself is done)", exc_info=True)


class RunnerError(RuntimeError):
    """The engine host itself failed (not a row), or is closed."""


class ShardAborted(RuntimeError):
    """``abort_shard`` stopped this shard: its rows left the engine, no results."""


@runtime_checkable
class ShardExecutor(Protocol):
    """Runs the rows of many shards through one engine, each shard abortable alone."""

    def run_shard(self, key: str, rows: list[RowRequest], on_row: RowCallback | None = None) -> list[RowResult]:
        """Run ``rows`` of shard ``key``; one RowResult each, in order (blocks until done).
        ``on_row`` is told of each row as it finishes."""
        ...

    def engine_reading(self) -> EngineReading | None:
        """The engine's load as last seen (None before its first step); any thread."""
        ...

    def abort_shard(self, key: str) -> bool:
        """Abort shard ``key``: its ``run_shard`` raises ShardAborted. Whether it was running."""
        ...

    def abort_all(self) -> int:
        """Abort every shard running here; how many."""
        ...

    def close(self) -> None:
        """Refuse new shards; shards still running fail (RunnerError or ShardAborted)."""
        ...
