"""The scheduler's vocabulary: its limits, what one step computes for each request, the
plan of the schedule() call in progress, and the checks on what a step may hold
(a prompt that can never fit, a chunk that would end inside a two-way image)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .kv_cache import blocks_needed
from .partial_blocks import BlockCopy
from .request import Request
from .window_blocks import WindowedLayout


class PromptTooLongError(ValueError):
    """A prompt can never be scheduled: longer than max_model_len or the whole KV cache."""


@dataclass
class SchedulerConfig:
    """The scheduler's limits (taken from the engine's EngineConfig)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    max_loras: int | None = None  # distinct LoRA adapters among running requests; None: no LoRA
    num_state_slots: int = 0  # per-request recurrent-state slots; 0: the model keeps no such state
    prefix_aware_admission: bool = True  # admit shared cached prefixes first (core/admission.py)
    # Recurrent states saved at cached block boundaries (prefix caching for hybrids); 0: none.
    num_state_snapshots: int = 0
    # Windowed layer groups with their own block tables and pools (core/window_blocks.py);
    # None: one table for all layers.
    windowed: WindowedLayout | None = None

    def __post_init__(self) -> None:
        limits = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks")
        for name in limits:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        # The caller sizes max_model_len to the cache, so a lone request always fits.
        assert self.max_model_len <= self.num_blocks * self.block_size, (
            self.max_model_len, self.num_blocks, self.block_size)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: it computes tokens [start, start + num_new_tokens).

    ``start`` is where computation begins (after any prefix-cache hit) and
    ``block_ids`` the request's whole block table after this step's allocation: the
    KV cache's own list (KVCacheManager.live_block_ids), read during this step and
    never modified. ``num_tokens`` is request.num_tokens (pending tokens included)
    when scheduled, so is_last_chunk holds after the engine appends the sampled token.
    """

    request: Request
    start: int
    num_new_tokens: int
    block_ids: list[int]
    num_tokens: int
    # The request's recurrent-state slot; -1 when the model keeps no recurrent state.
    state_slot: int = -1
    # A snapshot slot copied into state_slot before the step (a prefix hit); -1: none.
    restore_slot: int = -1
    # A snapshot slot state_slot is copied into after the step (a shared boundary); -1: none.
    save_slot: int = -1
    # Slots copied into the request's block before the step (a token-granular prefix hit,
    # counted in ``start``); None: none.
    block_copy: BlockCopy | None = None
    # The request's table in each windowed group (WindowedKVCacheManager.live_group_block_ids).
    group_block_ids: tuple[list[int], ...] = ()

    @property
    def is_last_chunk(self) -> bool:
        """The step reaches the request's last token, so the engine samples one."""
        return self.start + self.num_new_tokens == self.num_tokens


@dataclass
class SchedulerOutput:
    """What one step computes: running requests first, then newly admitted ones."""

    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    num_scheduled_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepPlan:
    """Decisions of the schedule() call in progress; undone for a preempted victim.
    A scheduled request's num_computed_tokens is advanced when it is added (and put
    back if it is unscheduled), so the step's requests are walked once."""

    token_budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def unschedule(self, request: Request) -> ScheduledRequest | None:
        for index in range(len(self.scheduled) - 1, -1, -1):
            scheduled = self.scheduled[index]
            if scheduled.request is request:
                del self.scheduled[index]
                self.token_budget += scheduled.num_new_tokens
                request.num_computed_tokens -= scheduled.num_new_tokens
                if scheduled.block_copy is not None:  # never copied: not computed either
                    request.num_computed_tokens -= scheduled.block_copy.num_tokens
                return scheduled
        return None


def check_prompt_fits(request: Request, config: SchedulerConfig) -> None:
    """Refuse a request the scheduler could never run: an empty prompt, one longer than
    max_model_len or the whole cache, or a two-way image wider than a step's budget."""
    num_prompt_tokens = request.num_prompt_tokens
    if num_prompt_tokens == 0:
        raise ValueError(
            f"request {request.request_id!r} has an empty prompt; at least one token is needed"
        )
    if num_prompt_tokens > config.max_model_len:
        raise PromptTooLongError(
            f"request {request.request_id!r}: prompt has {num_prompt_tokens} tokens, "
            f"more than max_model_len={config.max_model_len}"
        )
    num_blocks = blocks_needed(num_prompt_tokens + 1, config.block_size)
    if num_blocks > config.num_blocks:
        raise PromptTooLongError(
            f"request {request.request_id!r}: prompt has {num_prompt_tokens} tokens, which "
            f"with one generated token need {num_blocks} KV blocks of {config.block_size}, "
            f"more than the cache's {config.num_blocks} blocks "
            f"(limit {config.num_blocks * config.block_size - 1} prompt tokens)"
        )
    widest = max((image.end - image.start for image in request.images if image.bidirectional), default=0)
    if widest > config.max_num_batched_tokens:
        raise PromptTooLongError(
            f"request {request.request_id!r}: an image of {widest} tokens attends to itself both ways, "
            f"so it is computed in one step, and max_num_batched_tokens={config.max_num_batched_tokens} "
            f"is smaller; set max_num_batched_tokens to at least {widest}"
        )


def whole_images(request: Request, start: int, num_new_tokens: int) -> int:
    """``num_new_tokens`` cut so that the chunk [start, start + num_new_tokens) ends
    outside every image of the request whose rows attend to each other both ways: before
    the image it would end inside, or 0 where the chunk starts at or inside that image
    (the request waits for a step with room for the image's rest)."""
    end = start + num_new_tokens
    for image in request.images:
        if image.bidirectional and image.start < end < image.end:
            end = max(image.start, start)
    return end - start
