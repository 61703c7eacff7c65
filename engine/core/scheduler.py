"""Continuous batching under a token budget, with priorities and preemption by recompute.

There is no prefill or decode phase: each request has ``num_computed_tokens``
catching up with ``num_tokens`` (prompt plus sampled tokens). Every step hands out
at most ``max_num_batched_tokens`` tokens, running requests first, then waiting ones
in (priority, arrival) order; a prompt longer than what is left of the budget is
simply computed over several steps (chunked prefill falls out of the budget).

Invariants:
- A request is in exactly one of ``waiting`` (sorted, lower priority value first,
  then earlier arrival) or ``running`` (admission order) until it is finished.
- Only running requests hold KV blocks; preemption frees them all and restarts the
  request at num_computed_tokens = 0 (its freed blocks stay in the prefix cache, so
  the recompute is often a cache hit).
- The request with the largest (priority, arrival) key is the only victim, so the
  best running request always progresses: no deadlock, since one request alone
  fits the cache (max_model_len <= num_blocks * block_size).
- schedule() advances num_computed_tokens by what it schedules; the engine runs the
  step, appends a sampled token to each last-chunk request, and finishes requests.
- With async scheduling a running request may have one pending token (sampled by the
  step in flight, not yet appended): it counts as a token to compute, so the next
  step computes its position; a request whose pending token reaches its length limit
  is not scheduled again.
- With recurrent layers (num_state_slots > 0) every running request owns a state
  slot (core/state_slots.py), taken at admission or fork and given back at finish,
  abort and preemption; a request is admitted only when a slot is free.
- With recurrent layers and prefix caching (num_state_snapshots > 0) a prefix hit
  ends where a snapshot of the recurrent state was saved, and the step restores it
  into the request's slot. A prompt chunk is cut to end at the last block boundary
  another unfinished request's prompt shares, the one state another request can
  continue from, which the step saves (core/state_slots.py StateSnapshots).
- A prefix hit may end inside a block (attention-only models, core/partial_blocks.py):
  the step copies its last tokens' KV from the block holding them into the request's
  fresh block (ScheduledRequest.block_copy) before its forward; they count as computed
  from admission on, and a request unscheduled from the step gives them back.
- A chunk never ends inside an image whose rows attend to each other both ways
  (ImageInput.bidirectional, Gemma 3): it ends before the image, or the request waits
  for a step with room for the image's rest (``whole_images``); an image longer than
  max_num_batched_tokens is refused at add_request.
- Waiting requests are tried in (priority, arrival) order, or, with
  prefix_aware_admission, in the order of core/admission.py (priority still first,
  longest cached prefix next, an age bound so none starves).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

from ..outputs import EngineStats
from .admission import PrefixAwareAdmission
from .kv_cache import KVCacheManager
from .partial_blocks import BlockCopy
from .request import Request, RequestStatus
from .state_slots import StateSlots, StateSnapshots
from .step_plan import (
    PromptTooLongError,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
    StepPlan,
    check_prompt_fits,
    whole_images,
)
from .window_blocks import WindowedKVCacheManager

# The scheduler's vocabulary (core/step_plan.py) is imported from here too.
__all__ = ["PromptTooLongError", "ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput",
           "whole_images"]


class Scheduler:
    """Decides each step which requests compute which tokens, within the budget and KV cache."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.windowed_cache: WindowedKVCacheManager | None = None
        if config.windowed is not None:  # windowed layer groups with their own tables (window_blocks.py)
            self.windowed_cache = WindowedKVCacheManager(config.num_blocks, config.block_size,
                                                         config.enable_prefix_caching, config.windowed.groups,
                                                         config.windowed.num_blocks)
        # Recurrent layers continue only from states saved at block boundaries, so a hit
        # inside a block (partial_blocks.py) is for attention-only models.
        self.kv_cache = self.windowed_cache or KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching,
            partial_block_reuse=not config.num_state_slots,
        )
        self.state_slots = StateSlots(config.num_state_slots) if config.num_state_slots else None
        self.snapshots: StateSnapshots | None = None
        if config.num_state_slots and config.num_state_snapshots and config.enable_prefix_caching:
            self.snapshots = StateSnapshots(config.num_state_slots, config.num_state_snapshots)
            self.kv_cache.pool.snapshots = self.snapshots
        self.admission = PrefixAwareAdmission(self.kv_cache) if config.prefix_aware_admission else None
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        # Ties on (priority, arrival_index) fall back to the order of add_request.
        self._add_order: dict[str, int] = {}
        self._add_counter = itertools.count()
        self.num_preemptions = 0  # every preemption so far

    def add_request(self, request: Request) -> None:
        """Queue a request; raises PromptTooLongError if it could never be scheduled."""
        check_prompt_fits(request, self.config)
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        self._requests[request.request_id] = request
        self._add_order[request.request_id] = next(self._add_counter)
        request.status = RequestStatus.WAITING
        if self.snapshots is not None:
            self.snapshots.want(request.request_id, self.kv_cache.prefix_block_hashes(request))
        self._push_waiting(request)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; advances num_computed_tokens."""
        budget = self.config.max_num_batched_tokens
        step = StepPlan(token_budget=budget)
        if self.snapshots is not None:
            self.snapshots.begin_step()
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        return SchedulerOutput(
            scheduled=step.scheduled,
            preempted=step.preempted,
            num_scheduled_tokens=budget - step.token_budget,
        )

    def stats(self, num_steps: int = 0) -> EngineStats:
        """Requests running and waiting, KV-cache use, prefix-cache hit rate, preemptions."""
        kv_cache = self.kv_cache
        return EngineStats(
            num_running=len(self.running), num_waiting=len(self.waiting), kv_cache_usage=kv_cache.usage,
            prefix_cache_hit_rate=kv_cache.stats.hit_rate if kv_cache.enable_prefix_caching else None,
            num_preemptions=self.num_preemptions, num_steps=num_steps)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (or abort) requests: remove them, free their blocks, set ``status``.

        Unknown ids are ignored; returns the requests actually finished.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status!r}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished = []
        for request_id in request_ids:
            request = self._requests.pop(request_id, None)
            if request is None:
                continue
            self._add_order.pop(request_id)
            if self.admission is not None:
                self.admission.forget(request_id)
            (self.running if request in self.running else self.waiting).remove(request)
            self.kv_cache.free(request)
            self._free_state_slot(request)
            if self.snapshots is not None:
                self.snapshots.unwant(request_id)
            request.status = status
            finished.append(request)
        return finished

    def fork_request(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Run ``child`` (another sample of ``parent``'s prompt) on the parent's KV.

        Called right after the parent's prompt was computed: the child joins the
        running requests with the same computed tokens. Returns the (src, dst) block
        copy the runner must make, or None. Without a free block for that copy (or a
        free state slot, see ``state_slot``) the child waits instead and recomputes
        (reusing cached prefix blocks).
        """
        self._requests[child.request_id] = child
        self._add_order[child.request_id] = next(self._add_counter)
        try:
            if self.state_slots is not None and self.state_slots.allocate(child.request_id) is None:
                raise MemoryError("no free state slot")
            copy = self.kv_cache.fork(parent, child)
        except MemoryError:
            self._free_state_slot(child)
            child.status = RequestStatus.WAITING
            self._push_waiting(child)
            return None
        child.status = RequestStatus.RUNNING
        child.num_cached_tokens = parent.num_cached_tokens
        self.running.append(child)
        return copy

    def take_group_copies(self) -> list[list[tuple[int, int]]]:
        """The (src, dst) block copies of forks in each windowed group since the last call
        (empty without windowed groups), beside those fork_request returned."""
        return self.windowed_cache.take_group_copies() if self.windowed_cache is not None else []

    def drop_unsaved_snapshots(self, scheduler_output: SchedulerOutput) -> None:
        """Forget the snapshots a step that failed was to save."""
        if self.snapshots is not None:
            for item in scheduler_output.scheduled:
                if item.save_slot >= 0:
                    self.snapshots.drop_slot(item.save_slot)

    def state_slot(self, request_id: str) -> int | None:
        """The running request's recurrent-state slot (None without one)."""
        return self.state_slots.slot_of(request_id) if self.state_slots is not None else None

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # -- policies ---------------------------------------------------------------

    def _schedule_running(self, step: StepPlan) -> None:
        """Give each running request its missing tokens; out of blocks, preempt the
        lowest-priority latest-arrived running request (maybe the one at hand)."""
        running = RequestStatus.RUNNING
        allocate_slots = self.kv_cache.allocate_slots
        for request in list(self.running):  # a copy: preemption removes requests
            if request.status is not running:
                continue  # preempted earlier in this loop
            num_pending = request.num_pending_tokens
            num_tokens = request.num_tokens + num_pending
            if num_pending and self._reached_length(request, num_tokens):
                continue  # its pending token is its last: nothing more to compute
            num_new_tokens = whole_images(request, request.num_computed_tokens,
                                          min(num_tokens - request.num_computed_tokens, step.token_budget))
            if num_new_tokens <= 0:
                continue
            while not allocate_slots(request, num_new_tokens):
                victim = max(self.running, key=self._order_key)
                self._preempt(victim, step)
                if victim is request:
                    break
            else:
                self._add_to_step(step, request, request.num_computed_tokens, num_new_tokens, num_tokens)

    def _schedule_waiting(self, step: StepPlan) -> None:
        """Admit waiting requests in (priority, arrival) order or the admission policy's;
        stop at the first that does not fit (tokens, seq slots or blocks). A request whose
        adapter would exceed max_loras is passed over, not waited on: later ones may use
        loaded adapters."""
        if step.token_budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return
        order = list(self.waiting) if self.admission is None else self.admission.order(self.waiting, self.running)
        for request in order:
            if step.token_budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if not self._lora_fits(request):
                continue  # its adapter would exceed max_loras; a later request may fit
            if request in step.preempted or not self._admit(request, step):
                return

    def _lora_fits(self, request: Request) -> bool:
        """Running requests never use more than max_loras distinct adapters, so every
        step's adapters fit the LoRA slots."""
        if self.config.max_loras is None or request.lora_request is None:
            return True
        active = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return request.lora_request.lora_int_id in active or len(active) < self.config.max_loras

    def _admit(self, request: Request, step: StepPlan) -> bool:
        """Commit the request's prefix hit and first chunk; may preempt strictly
        lower-priority running requests to find blocks."""
        if self.state_slots is not None and self.state_slots.num_free == 0:
            return False
        while True:
            hit_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            src_block, num_copied = self.kv_cache.partial_hit(request, len(hit_blocks))
            num_new_tokens = whole_images(request, num_hit_tokens + num_copied,
                                          min(request.num_tokens - num_hit_tokens - num_copied, step.token_budget))
            if num_new_tokens <= 0:
                return False  # an image attending both ways waits for a step with room for it whole
            if self.kv_cache.allocate_slots(request, num_new_tokens, hit_blocks, num_copied):
                break
            victim = self._priority_victim(request)
            if victim is None:
                return False
            self._preempt(victim, step)
        self.waiting.remove(request)
        self.running.append(request)
        if self.state_slots is not None:
            self.state_slots.allocate(request.request_id)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens + num_copied
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens + num_copied
        restore_slot = -1
        if self.snapshots is not None and hit_blocks:
            restore_slot = self.snapshots.use(self.kv_cache.prefix_block_hashes(request)[len(hit_blocks) - 1])
        block_copy = None
        if num_copied:
            dst_block = self.kv_cache.live_block_ids(request.request_id)[len(hit_blocks)]
            block_copy = BlockCopy(src_block, dst_block, num_copied)
        self._add_to_step(step, request, num_hit_tokens + num_copied, num_new_tokens, request.num_tokens,
                          restore_slot, block_copy)
        return True

    def _priority_victim(self, request: Request) -> Request | None:
        """The lowest-priority running request, if strictly below ``request``'s priority."""
        if not self.running:
            return None
        victim = max(self.running, key=self._order_key)
        return victim if victim.priority > request.priority else None

    def _preempt(self, victim: Request, step: StepPlan) -> None:
        """Preempt by recompute: free all blocks, restart at token 0, back to waiting."""
        self.running.remove(victim)
        unscheduled = step.unschedule(victim)
        if unscheduled is not None and unscheduled.save_slot >= 0 and self.snapshots is not None:
            self.snapshots.drop_slot(unscheduled.save_slot)  # never written
        self.kv_cache.free(victim)
        self._free_state_slot(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.append(victim)
        self._push_waiting(victim)

    # -- helpers ----------------------------------------------------------------

    def _reached_length(self, request: Request, num_tokens: int) -> bool:
        """Whether ``num_tokens`` (pending ones included) end the request by length."""
        num_output = num_tokens - request.num_prompt_tokens
        return num_tokens >= self.config.max_model_len or (
            request.max_tokens is not None and num_output >= request.max_tokens)

    def _add_to_step(self, step: StepPlan, request: Request, start: int, num_new_tokens: int,
                     num_tokens: int, restore_slot: int = -1, block_copy: BlockCopy | None = None) -> None:
        request_id = request.request_id
        slot = -1
        if self.state_slots is not None:
            slot = self.state_slots.slot_of(request_id)
            slot = -1 if slot is None else slot
        save_slot = -1
        if self.snapshots is not None:
            num_new_tokens, save_slot = self._snapshot_cut(request, start, num_new_tokens)
        group_block_ids = (self.windowed_cache.live_group_block_ids(request_id)
                           if self.windowed_cache is not None else ())
        step.scheduled.append(ScheduledRequest(
            request, start, num_new_tokens, self.kv_cache.live_block_ids(request_id), num_tokens, slot,
            restore_slot, save_slot, block_copy, group_block_ids=group_block_ids))
        step.token_budget -= num_new_tokens
        request.num_computed_tokens = start + num_new_tokens

    def _snapshot_cut(self, request: Request, start: int, num_new_tokens: int) -> tuple[int, int]:
        """(the chunk's tokens, the snapshot slot its end state is saved in, or -1): a
        prompt chunk crossing a block boundary that another request's prompt shares ends
        at the last such boundary, unless its state is saved already."""
        snapshots = self.snapshots
        assert snapshots is not None
        block_size = self.config.block_size
        last = min(start + num_new_tokens, request.num_prompt_tokens - 1) // block_size
        if last <= start // block_size:
            return num_new_tokens, -1
        block_hashes = self.kv_cache.prefix_block_hashes(request)
        for index in range(last - 1, start // block_size - 1, -1):
            block_hash = block_hashes[index]
            if snapshots.num_wanting(block_hash) < 2:
                continue
            if snapshots.slot_of(block_hash) is not None:
                return num_new_tokens, -1  # saved or being saved: continue past it
            save_slot = snapshots.claim(block_hash)
            if save_slot is None:
                return num_new_tokens, -1
            return (index + 1) * block_size - start, save_slot
        return num_new_tokens, -1

    def _free_state_slot(self, request: Request) -> None:
        if self.state_slots is not None:
            self.state_slots.free(request.request_id)

    def _order_key(self, request: Request) -> tuple[int, int, int]:
        return (request.priority, request.arrival_index, self._add_order[request.request_id])

    def _push_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._order_key)
        if self.admission is not None:
            self.admission.queued(request)
