"""Per-request state shared by the scheduler, the KV cache manager and the engine loop.

There is no prefill or decode phase: each request has ``num_computed_tokens`` catching
up with ``num_tokens`` (prompt plus generated tokens). A step computes some of the
missing tokens; when it reaches the end, the engine samples one new token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Annotations only: core/ imports nothing above it at run time.
    from ..lora.request import LoRARequest
    from ..multimodal.inputs import ImageInput
    from ..params import PoolingParams, SamplingParams


# A prefix-cache salt. It is hashed through its repr, so only values whose repr is the
# same in every process (not Python's per-process str hash): str, int, tuples of those.
CacheSalt = str | int | tuple[str | int, ...]


class RequestStatus(enum.Enum):
    """A request's place in its life; ``value`` is the finish_reason of a finished one.
    ``is_finished`` is a plain attribute of each member (read for every sampled token)."""

    WAITING = ("waiting", False)
    RUNNING = ("running", False)
    PREEMPTED = ("preempted", False)
    FINISHED_STOPPED = ("stop", True)
    FINISHED_LENGTH = ("length", True)
    FINISHED_ABORTED = ("abort", True)

    is_finished: bool  # set on each member by __new__ (an annotation, not a member)

    def __new__(cls, value: str, is_finished: bool) -> RequestStatus:
        member = object.__new__(cls)
        member._value_ = value
        member.is_finished = is_finished
        return member


@dataclass(eq=False, slots=True)
class Request:
    """One sequence being generated (one sample of a request when n > 1).

    ``params`` is opaque to the scheduler and the KV cache (None only for requests
    built by tests of those two); ``max_tokens`` is already resolved against
    max_model_len. ``cache_salt`` separates prefix-cache entries that must not be
    shared (for example different LoRA adapters, ``lora_cache_salt``): it is folded
    into the first block hash. ``images``: the prompt's images (opaque here but for
    their hashes and spans, which the KV cache folds into the hashes of the blocks
    they fill).
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0
    arrival_index: int = 0
    params: SamplingParams | PoolingParams | None = None
    cache_salt: CacheSalt | None = None
    lora_request: LoRARequest | None = None
    prompt: str | None = None
    images: tuple[ImageInput, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache at first admission.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # Tokens sampled by a step whose outputs the engine has not processed yet (async
    # scheduling): they count for scheduling (the next step computes the position of
    # one, reading it on the device) but are not in output_token_ids.
    num_pending_tokens: int = 0
    # len(output_token_ids) and len(prompt_token_ids) + len(output_token_ids), kept by
    # append_output_token (the only way tokens are added): read for every request in
    # every step by the scheduler, the runner and the stop checks.
    num_output_tokens: int = field(init=False)
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_output_tokens = len(self.output_token_ids)
        self.num_tokens = len(self.prompt_token_ids) + self.num_output_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def image_hashes_in(self, start: int, end: int) -> tuple[str, ...]:
        """Hashes of the prompt's images that fill any position in [start, end)."""
        return tuple(image.image_hash for image in self.images if image.start < end and image.end > start)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.num_output_tokens += 1
        self.num_tokens += 1
