"""Prefix-aware admission: the order in which the scheduler tries waiting requests.

An offline batch repeats a few long prefixes (an instruction, a schema, few-shot
examples) in front of most rows. Admitting in arrival order interleaves them, so a
cache that holds only a few of them evicts each before its next user arrives; this
policy admits first the requests whose prompts continue the longest run of cached
blocks (running requests' computed blocks are cached too), and holds back a request
whose prompt goes on into blocks another request is computing right now, so the
first request of a group computes the shared prefix and the rest hit it.

Invariants:
- Priority first: every waiting request of a lower priority value is tried before
  any of a higher one, as with arrival order; the scheduler still stops at the first
  request that does not fit, so a request is never passed over for lack of room.
- Within one priority, overdue requests (queued more than ``max_wait_steps``
  admission rounds ago: schedule calls with room for a waiting request) come first,
  in arrival order, and are never held back: no request starves behind a stream of
  better-cached ones.
- Then the longest cached prefix (in blocks) first; ties in the waiting queue's
  (priority, arrival) order. Without prefix hits anywhere the order is arrival order.
- A request with no cached block starts a new prefix only while the free blocks, less
  its prompt's and one for each waiting request sharing its first block, still hold
  one block for every waiting request of the groups already running (or when nothing
  runs): starting prefixes never crowds out the groups already started. Such a
  request ends the round as one that does not fit would, unless it may preempt a
  running request of a higher priority value (priority comes first).
- A held-back request stays waiting and is tried again next step; only the order
  changes, never the scheduler's checks (tokens, sequences, blocks, adapters, slots).
- Free cached blocks that waiting requests would hit are moved to the end of the
  eviction queue before admission allocates, so wanted prefixes stay resident longest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

from .kv_cache import BlockHash, KVCacheBlock, KVCacheManager, blocks_needed
from .request import Request, RequestStatus

# Admission rounds a request may wait before it goes first among its priority.
DEFAULT_MAX_WAIT_STEPS = 64


class PrefixAwareAdmission:
    """Orders waiting requests by the prefix they share with cached or running blocks."""

    def __init__(self, kv_cache: KVCacheManager, max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS) -> None:
        if max_wait_steps <= 0:
            raise ValueError(f"max_wait_steps must be a positive integer, got {max_wait_steps!r}")
        self.kv_cache = kv_cache
        self.max_wait_steps = max_wait_steps
        self._num_orders = 0  # admission rounds so far
        self._queued_at: dict[str, int] = {}  # request id -> the admission round it was first queued in

    def queued(self, request: Request) -> None:
        """A request joined the waiting queue; its age counts from its first queueing
        (a preempted request keeps its age)."""
        self._queued_at.setdefault(request.request_id, self._num_orders)

    def forget(self, request_id: str) -> None:
        """A request finished or was aborted."""
        self._queued_at.pop(request_id, None)

    def order(self, waiting: Sequence[Request], running: Sequence[Request]) -> Iterator[Request]:
        """Waiting requests in the order to try them (``waiting`` is the (priority,
        arrival)-sorted queue; it may shrink while this is iterated, as requests are
        admitted). A request held back this step is not yielded."""
        self._num_orders += 1
        if not self.kv_cache.enable_prefix_caching or not waiting:
            yield from list(waiting)
            return
        hit_blocks = {request.request_id: self.kv_cache.get_computed_blocks(request)[0] for request in waiting}
        ranked = sorted(range(len(waiting)), key=lambda index: self._rank(waiting[index], index, hit_blocks))
        ranked_requests = [waiting[index] for index in ranked]
        self._keep_wanted(ranked_requests, hit_blocks)
        computing = self._computing(running)
        groups = _Groups(self.kv_cache, waiting, running)
        for request in ranked_requests:
            if not self._is_overdue(request):
                num_hit_blocks = len(hit_blocks[request.request_id])
                if self._continues_into(request, num_hit_blocks, computing):
                    continue  # another request computes its next blocks now: hit them next step
                if not num_hit_blocks and running and not groups.room_to_start(request) \
                        and not any(other.priority > request.priority for other in running):
                    return  # a new prefix now would crowd out the groups already started: as not fitting
            yield request
            if request.status is RequestStatus.RUNNING:  # admitted: its prefix is being computed now
                computing.update(self.kv_cache.uncomputed_prompt_hashes(request))
                groups.admitted(request)

    def rounds_waited(self, request: Request) -> int:
        """Admission rounds since the request was first queued (0 for one not queued)."""
        return self._num_orders - self._queued_at.get(request.request_id, self._num_orders)

    def _rank(self, request: Request, index: int, hit_blocks: dict[str, list[KVCacheBlock]]) \
            -> tuple[int, int, int, int]:
        if self._is_overdue(request):
            return (request.priority, 0, 0, index)
        return (request.priority, 1, -len(hit_blocks[request.request_id]), index)

    def _is_overdue(self, request: Request) -> bool:
        return self.rounds_waited(request) > self.max_wait_steps

    def _continues_into(self, request: Request, num_hit_blocks: int, computing: set[BlockHash]) -> bool:
        """Whether the request's first uncached block is one a running request computes now."""
        if not computing:
            return False
        hashes = self.kv_cache.prefix_block_hashes(request)
        return num_hit_blocks < len(hashes) and hashes[num_hit_blocks] in computing

    def _computing(self, running: Sequence[Request]) -> set[BlockHash]:
        """Hashes of prompt blocks that running requests hold but have not cached yet."""
        computing: set[BlockHash] = set()
        for request in running:
            computing.update(self.kv_cache.uncomputed_prompt_hashes(request))
        return computing

    def _keep_wanted(self, ranked: list[Request], hit_blocks: dict[str, list[KVCacheBlock]]) -> None:
        """Move the blocks waiting requests would hit to the end of the eviction queue:
        the best-ranked request's blocks last, and a chain's first blocks (shared by
        more prompts) after its later ones."""
        seen: set[int] = set()
        most_wanted_first: list[KVCacheBlock] = []
        for request in ranked:
            for block in hit_blocks[request.request_id]:
                if block.block_id not in seen:
                    seen.add(block.block_id)
                    most_wanted_first.append(block)
        self.kv_cache.keep_resident(most_wanted_first[::-1])


class _Groups:
    """Waiting requests grouped by their first block (a template's rows share it), and
    the blocks to keep for the groups that already run: one per waiting member."""

    def __init__(self, kv_cache: KVCacheManager, waiting: Sequence[Request], running: Sequence[Request]) -> None:
        self.kv_cache = kv_cache
        self.num_waiting: Counter[BlockHash] = Counter()
        for request in waiting:
            first = self._first_hash(request)
            if first is not None:
                self.num_waiting[first] += 1
        self.started = {first for request in running if (first := self._first_hash(request)) is not None}
        self.reserved = sum(self.num_waiting[first] for first in self.started)

    def room_to_start(self, request: Request) -> bool:
        first = self._first_hash(request)
        followers = self.num_waiting[first] - 1 if first is not None else 0
        needed = blocks_needed(request.num_tokens, self.kv_cache.block_size) + followers
        return self.kv_cache.num_free_blocks - needed >= self.reserved

    def admitted(self, request: Request) -> None:
        first = self._first_hash(request)
        if first is None:
            return
        self.num_waiting[first] -= 1
        if first in self.started:
            self.reserved -= 1
        else:
            self.started.add(first)
            self.reserved += self.num_waiting[first]

    def _first_hash(self, request: Request) -> BlockHash | None:
        return self.kv_cache.first_block_hash(request)
