"""What LLM asks of an engine: the interface both the generation and the pooling
engine implement, so LLM drives either without reaching into its internals."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from .outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput


class Engine(Protocol):
    """An engine driven by ``step()``; requests are identified by the caller's ids."""

    # "generate" or "embed": what LLM may ask of this engine.
    task: str
    tokenizer: Any

    def add_request(self, request_id: str, prompt: Any, params: Any, lora_request: Any = None,
                    priority: int = 0) -> None:
        """Queue a request; raises ValueError naming it if it can never run."""

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Drop requests wherever they are; unknown ids are ignored."""

    def abort_all(self) -> None:
        """Drop every unfinished request."""

    def has_unfinished_requests(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def has_capacity(self) -> bool:
        """Whether adding more requests before the next step still pays (the engine
        holds less than two steps' worth of sequences)."""
        ...

    def step(self) -> Sequence[RequestOutput | EmbeddingRequestOutput | PoolingRequestOutput]:
        """Run one iteration; return the outputs of requests that finished in it."""
        ...

    def close(self) -> None:
        """Abort everything and release what the engine holds besides memory (threads)."""
