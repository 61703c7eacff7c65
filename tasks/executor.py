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
- RowRequest and RowResult pickle (they cross the service's socket).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # the engine's public types, for annotations only
    from shardline import EmbeddingRequestOutput, LoRARequest, PoolingParams, RequestOutput, SamplingParams


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


@dataclass
class RowResult:
    """What became of one row: the engine's final output, or why it failed."""

    index: int
    output: RequestOutput | EmbeddingRequestOutput | None = None
    error: str | None = None


class RunnerError(RuntimeError):
    """The engine host itself failed (not a row), or is closed."""


class ShardAborted(RuntimeError):
    """``abort_shard`` stopped this shard: its rows left the engine, no results."""


@runtime_checkable
class ShardExecutor(Protocol):
    """Runs the rows of many shards through one engine, each shard abortable alone."""

    def run_shard(self, key: str, rows: list[RowRequest]) -> list[RowResult]:
        """Run ``rows`` of shard ``key``; one RowResult each, in order (blocks until done)."""
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
