"""The shard runner's bookkeeping: one shard's work inside the runner, the driver's
statistics, the backoff policy for failed groups, and how a step's error is read."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardline.engine.outputs import PoolingRequestOutput

from .executor import RowCallback, RowRequest, RowResult, report_row, row_done

if TYPE_CHECKING:
    from shardline.engine.outputs import EmbeddingRequestOutput, RequestOutput

    from .image_prompts import Prepared

    EngineOutput = RequestOutput | EmbeddingRequestOutput | PoolingRequestOutput


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff for groups that failed in a step: delay(depth) = base * 2**(depth-1), capped."""

    base_delay: float = 0.05
    max_delay: float = 2.0
    max_row_attempts: int = 2

    def delay(self, depth: int) -> float:
        return min(self.max_delay, self.base_delay * 2 ** max(depth - 1, 0))


@dataclass
class DriverStats:
    """What the driver loop did: steps, seconds inside them, and seconds it waited for
    rows with nothing in flight. Tells a starved engine from a slow one."""

    steps: int = 0
    requests_added: int = 0  # engine requests, retries included: the engine work asked for
    step_seconds: float = 0.0
    idle_seconds: float = 0.0
    first_step_at: float | None = None  # time.monotonic() of the first and last step
    last_step_at: float | None = None
    idle_since: float | None = None  # set while the driver waits with nothing in flight

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "requests_added": self.requests_added, "step_seconds": round(self.step_seconds, 3),
                "idle_seconds": round(self.idle_seconds, 3),
                "active_seconds": round((self.last_step_at or 0.0) - (self.first_step_at or 0.0), 3)}


@dataclass(eq=False)
class ShardWork:
    """One shard inside the runner: rows still to add, results so far, a done event."""

    key: str
    rows: list[RowRequest]
    request_prefix: str  # unique in the runner: the key and the shard's serial
    on_row: RowCallback | None = None
    prepared: dict[int, Prepared] = field(default_factory=dict)  # image rows' prompts, by position
    next_row: int = 0
    results: dict[int, RowResult] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    failure: BaseException | None = None

    def complete(self, position: int, result: RowResult) -> None:
        self.results[position] = result
        if self.on_row is not None:
            report_row(self.on_row, row_done(result))
        if len(self.results) == len(self.rows):
            self.done.set()


def engine_is_gone(exc: BaseException) -> bool:
    """Whether a step's error says the engine cannot run another step (a tensor-parallel
    rank died or stopped answering): no row is to blame, so recovery would only turn
    every row into an error row."""
    from shardline.engine.parallel.group import TensorParallelError  # torch is loaded: an engine ran

    return isinstance(exc, TensorParallelError)


def row_output(output: EngineOutput) -> RequestOutput | EmbeddingRequestOutput:
    """A finished request's output as a row's result: the runner adds generate and embed
    requests only, never other pooling tasks."""
    assert not isinstance(output, PoolingRequestOutput), f"request {output.request_id} was a pooling task"
    return output
