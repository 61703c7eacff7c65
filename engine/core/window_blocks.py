"""Block tables per layer group, for models whose layers read different spans of the
context: a full-attention layer reads every earlier token, a sliding-window layer the
last ``window`` tokens (keys k with q - k < window), a chunked-attention layer its own
aligned chunk of ``chunk`` tokens.

Layers that read the same span form one group. The primary group (the full layers, and
every layer outside the windowed groups) keeps KVCacheManager's table and pool; each
windowed group has its own pool (its layers' tensors hold that many blocks) and each
request one table there, so that a windowed group hands back the blocks no later query
of the request reads while the full layers keep them. A dropped entry points at block 0
of its pool, the null block, which is never handed out nor written: tables keep one
entry per logical block, and an attention path reads there only keys its window or
chunk masks (or skips).

Invariants (WindowedKVCacheManager):
- Every windowed table has as many entries as the request's primary table; entry i is
  None (id NULL_BLOCK_ID) exactly for i below the request's dropped count, and blocks
  are dropped only below first_read(num_computed_tokens) // block_size, which no query
  from num_computed_tokens on reads.
- A table whose entries were dropped is a new id list (never an in-place overwrite), so
  a reader that keeps the old list rewrites its copy (engine/model/input_batch.py).
- Prefix caching: a windowed group's computed full blocks carry the same chained hashes
  as the primary's, registered before they are dropped; a prefix hit of k blocks is
  taken only where every windowed group still caches the blocks from
  first_read(k * block_size) // block_size to k - 1, the ones the request's next query reads.

Pure Python (no torch): the runner sizes each group's tensors from the layout's counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .kv_cache import BlockHash, BlockPool, KVCacheBlock, KVCacheManager, blocks_needed
from .request import Request

NULL_BLOCK_ID = 0
FULL, SLIDING, CHUNKED = "full", "sliding_window", "chunked"


@dataclass(frozen=True)
class LayerGroup:
    """Layers that read the same span of the context: ``kind`` FULL, SLIDING (``span``
    the window) or CHUNKED (``span`` the chunk size)."""

    kind: str
    span: int | None
    layers: tuple[int, ...]

    def first_read(self, position: int) -> int:
        """Lowest key position that a query at ``position`` or any later one reads."""
        if self.kind == SLIDING:
            assert self.span is not None
            return max(0, position - self.span + 1)
        if self.kind == CHUNKED:
            assert self.span is not None
            return position // self.span * self.span
        return 0

    def blocks_held(self, num_tokens: int, max_new_tokens: int, block_size: int) -> int:
        """Most blocks (the null block aside) a request holds in this group while its
        context grows to ``num_tokens``, computing at most ``max_new_tokens`` per step."""
        full = blocks_needed(num_tokens, block_size)
        if self.kind == FULL:
            return full
        assert self.span is not None
        return min(full, blocks_needed(self.span + max_new_tokens, block_size) + 1)


def layer_groups(layers: Sequence[tuple[str, int | None]]) -> tuple[LayerGroup, ...]:
    """Group layer indices by (kind, span), in order of first appearance. ``layers``:
    each layer's kind and its window or chunk size (None for a full layer). A kind
    other than the three attention kinds is refused, naming the layer."""
    members: dict[tuple[str, int | None], list[int]] = {}
    for index, (kind, span) in enumerate(layers):
        if kind not in (FULL, SLIDING, CHUNKED):
            raise ValueError(f"layer {index}: kind {kind!r} has no block table of keys and values")
        if kind != FULL and (span is None or span <= 0):
            raise ValueError(f"layer {index}: a {kind} layer needs a positive window or chunk size, got {span!r}")
        members.setdefault((kind, span if kind != FULL else None), []).append(index)
    return tuple(LayerGroup(kind, span, tuple(indices)) for (kind, span), indices in members.items())


def split_budget(groups: Sequence[LayerGroup], group_block_bytes: Sequence[int], budget_bytes: int,
                 block_size: int, model_len: int, max_step_tokens: int, max_num_seqs: int) -> list[int]:
    """Blocks per group (null block included) from one byte budget; ``group_block_bytes``:
    one block of each group, all its layers, in bytes.

    Each group gets blocks in proportion to what a request at ``model_len`` holds there
    between steps (a windowed group: its window, one token and the block a step may
    start), for at most ``max_num_seqs`` requests; a windowed group also keeps a
    reserve of one step's tokens for the prompt chunk in flight. A pool short of its
    part makes the scheduler preempt, as a short primary pool does."""
    full = blocks_needed(model_len, block_size)
    held = [count if count == full else count + 1
            for count in (group.blocks_held(model_len, 1, block_size) for group in groups)]
    reserve = [0 if count == full else blocks_needed(max_step_tokens, block_size) for count in held]
    per_request = sum(count * size for count, size in zip(held, group_block_bytes, strict=True))
    reserved = sum(count * size for count, size in zip(reserve, group_block_bytes, strict=True))
    num_requests = min(max(0, budget_bytes - reserved) / per_request, max_num_seqs)
    return [math.floor(num_requests * count) + extra + 1 for count, extra in zip(held, reserve, strict=True)]


@dataclass(frozen=True)
class WindowedLayout:
    """How a model's cache layers split into block tables: windowed group g (``groups[g]``)
    has a pool of ``num_blocks[g]`` blocks, null block included, and its layers read table
    g + 1; every other layer reads the primary table (KVCacheManager's own)."""

    groups: tuple[LayerGroup, ...]
    num_blocks: tuple[int, ...]
    layer_groups: tuple[int, ...]  # per cache layer: 0 the primary table, g + 1 windowed group g

    def layer_num_blocks(self, primary_blocks: int) -> list[int]:
        """Each cache layer's number of blocks, the primary group's being ``primary_blocks``."""
        counts = (primary_blocks, *self.num_blocks)
        return [counts[group] for group in self.layer_groups]


class WindowedKVCacheManager(KVCacheManager):
    """KVCacheManager for the primary group, plus one pool and one table per request for
    each windowed group, whose blocks no later query reads go back to the pool (see the
    module's invariants). A request is given blocks only when every pool has its part."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 groups: Sequence[LayerGroup], group_num_blocks: Sequence[int]) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        # Hits end at block boundaries: a copy of a partial block's slots (core/partial_blocks.py)
        # would have to be made in every group's pool.
        self.pool.partial = None
        if not groups or len(groups) != len(group_num_blocks) or any(count < 2 for count in group_num_blocks) \
                or any(group.kind == FULL for group in groups):
            raise ValueError(f"each of the {len(groups)} windowed groups needs 2 or more blocks (one is the null "
                             f"block), got {list(group_num_blocks)}")
        self.groups = tuple(groups)
        self.group_pools = [BlockPool(count) for count in group_num_blocks]
        for pool in self.group_pools:
            (null,) = pool.allocate(1)  # the front of the free queue: block 0, held forever
            assert null.block_id == NULL_BLOCK_ID
        self._group_tables: dict[str, list[list[KVCacheBlock | None]]] = {}
        self._group_ids: dict[str, list[list[int]]] = {}
        self._group_dropped: dict[str, list[int]] = {}
        self._group_registered: dict[str, list[int]] = {}
        self._group_copies: list[list[tuple[int, int]]] = [[] for _ in groups]

    def num_free_group_blocks(self, group: int) -> int:
        return self.group_pools[group].num_free_blocks

    def live_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's table in each windowed group as block ids (dropped entries
        NULL_BLOCK_ID): lists extended in place as tables grow and replaced when
        entries are dropped. Never modify them."""
        return tuple(self._group_ids[request_id])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """KVCacheManager's hit, cut to the longest one every windowed group can continue."""
        hit_blocks, num_hit_tokens = super().get_computed_blocks(request)
        num_hit = len(hit_blocks)
        if num_hit:
            block_hashes = self._request_block_hashes(request, num_hit)
            while num_hit and self._group_hits(block_hashes, num_hit) is None:
                num_hit -= 1
        if num_hit == len(hit_blocks):
            return hit_blocks, num_hit_tokens
        return hit_blocks[:num_hit], num_hit * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (), num_copied_tokens: int = 0) -> bool:
        """Drop the blocks no query from request.num_computed_tokens on reads, then grow
        every table as KVCacheManager.allocate_slots grows the primary one. Returns False
        (having dropped only blocks nobody reads) when some pool cannot supply its part."""
        assert not num_copied_tokens, "no partial-block hits with windowed groups"
        request_id = request.request_id
        tables = self._group_tables.get(request_id)
        if tables is not None:
            self._drop_unread(request)
        num_hit = len(new_computed_blocks)
        hits = self._group_hits(self._request_block_hashes(request, num_hit), num_hit) if num_hit else None
        assert hits is not None or not num_hit, "a prefix hit that a windowed group no longer caches"
        num_held = len(tables[0]) if tables is not None else 0
        num_tokens = request.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        num_missing = max(0, blocks_needed(num_tokens, self.block_size) - num_held - num_hit)
        for group, pool in enumerate(self.group_pools):
            num_revived = sum(1 for block in hits[group] if block is not None and block.ref_cnt == 0) if hits else 0
            if num_missing > pool.num_free_blocks - num_revived:
                return False
        if not super().allocate_slots(request, num_new_tokens, new_computed_blocks):
            return False
        if tables is None:
            tables = self._group_tables[request_id] = [[] for _ in self.groups]
            self._group_ids[request_id] = [[] for _ in self.groups]
            first = [0 if hits is None else sum(1 for block in hits[g] if block is None) for g in range(len(tables))]
            self._group_dropped[request_id] = first
            self._group_registered[request_id] = [num_hit] * len(self.groups)
        for group, (pool, table) in enumerate(zip(self.group_pools, tables, strict=True)):
            if hits is not None:
                pool.touch([block for block in hits[group] if block is not None])
            added = [*(hits[group] if hits is not None else ()), *pool.allocate(num_missing)]
            if added:
                table.extend(added)
                self._group_ids[request_id][group].extend(
                    NULL_BLOCK_ID if block is None else block.block_id for block in added)
        self._register_groups(request)
        return True

    def free(self, request: Request) -> None:
        """KVCacheManager.free, then every windowed table, tail first."""
        super().free(request)  # registers the windowed groups' computed blocks too
        tables = self._group_tables.pop(request.request_id, None)
        if tables is None:
            return
        for pool, table in zip(self.group_pools, tables, strict=True):
            pool.release([block for block in reversed(table) if block is not None])
        for records in (self._group_ids, self._group_dropped, self._group_registered):
            del records[request.request_id]

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """KVCacheManager.fork in every group: full blocks shared, the partial last one
        copied; the windowed groups' copies are taken with ``take_group_copies``."""
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        if partial and any(pool.num_free_blocks < 1 for pool in self.group_pools):
            raise MemoryError("no free KV block of a windowed group to copy the partial block into")
        copy = super().fork(parent, child)
        parent_tables = self._group_tables[parent.request_id]
        tables, block_ids = [], []
        for group, (pool, table) in enumerate(zip(self.group_pools, parent_tables, strict=True)):
            shared = table[:num_full]
            pool.touch([block for block in shared if block is not None])
            own = pool.allocate(1) if partial else []
            if partial:
                source = table[num_full]
                assert source is not None, "the block being written was dropped"
                self._group_copies[group].append((source.block_id, own[0].block_id))
            tables.append([*shared, *own])
            block_ids.append([NULL_BLOCK_ID if block is None else block.block_id for block in tables[-1]])
        self._group_tables[child.request_id] = tables
        self._group_ids[child.request_id] = block_ids
        self._group_dropped[child.request_id] = [min(count, num_full) for count in
                                                 self._group_dropped[parent.request_id]]
        self._group_registered[child.request_id] = [0] * len(self.groups)
        return copy

    def take_group_copies(self) -> list[list[tuple[int, int]]]:
        """The (src, dst) block copies forks made in each windowed group since the last call."""
        copies, self._group_copies = self._group_copies, [[] for _ in self.groups]
        return copies

    def reset_prefix_cache(self) -> int:
        for pool in self.group_pools:
            pool.reset()
        return super().reset_prefix_cache()

    def _register_computed(self, request: Request) -> None:
        super()._register_computed(request)
        if request.request_id in self._group_tables:
            self._register_groups(request)

    def _register_groups(self, request: Request) -> None:
        """Offer each windowed group's held full blocks below num_computed_tokens to its cache."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        tables, registered = self._group_tables[request_id], self._group_registered[request_id]
        num_full = min(min(request.num_computed_tokens, request.num_tokens) // self.block_size, len(tables[0]))
        if all(num_full <= count for count in registered):
            return
        block_hashes = self._request_block_hashes(request, num_full)
        for group, (pool, table) in enumerate(zip(self.group_pools, tables, strict=True)):
            for index in range(registered[group], num_full):
                block = table[index]
                if block is not None:
                    pool.register(block, block_hashes[index])
            registered[group] = max(registered[group], num_full)

    def _group_hits(self, block_hashes: Sequence[BlockHash],
                    num_hit: int) -> list[list[KVCacheBlock | None]] | None:
        """Each windowed group's entries for a prefix hit of ``num_hit`` blocks (None
        below what the next query reads), or None when some group no longer caches one."""
        hits = []
        for group, pool in zip(self.groups, self.group_pools, strict=True):
            first = min(group.first_read(num_hit * self.block_size) // self.block_size, num_hit)
            entries: list[KVCacheBlock | None] = [None] * first
            for block_hash in block_hashes[first:num_hit]:
                block = pool.cached_blocks.get(block_hash)
                if block is None:
                    return None
                entries.append(block)
            hits.append(entries)
        return hits

    def _drop_unread(self, request: Request) -> None:
        """Give back, in each windowed group, the blocks no query from
        request.num_computed_tokens on reads (registered for prefix caching first)."""
        self._register_groups(request)
        request_id = request.request_id
        tables, dropped = self._group_tables[request_id], self._group_dropped[request_id]
        for group_index, group in enumerate(self.groups):
            table = tables[group_index]
            num_unread = min(group.first_read(request.num_computed_tokens) // self.block_size, len(table))
            if num_unread <= dropped[group_index]:
                continue
            released = [block for block in table[dropped[group_index]:num_unread] if block is not None]
            table[dropped[group_index]:num_unread] = [None] * (num_unread - dropped[group_index])
            block_ids = list(self._group_ids[request_id][group_index])  # a new list: readers rewrite their copy
            block_ids[dropped[group_index]:num_unread] = [NULL_BLOCK_ID] * (num_unread - dropped[group_index])
            self._group_ids[request_id][group_index] = block_ids
            self.group_pools[group_index].release(released)
            dropped[group_index] = num_unread
