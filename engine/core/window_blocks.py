"""Block tables per layer group, for models whose layers read different spans of the
context: a full-attention layer reads every earlier token, a sliding-window layer the
last ``window`` tokens (keys k with q - k < window), a chunked-attention layer its own
aligned chunk of ``chunk`` tokens.

Layers that read the same span form one group; each group has its own pool of blocks
(its layers' tensors hold that many blocks) and each request one table per group, so
that a windowed group can hand back the blocks no later query of the request reads
while the full group keeps them. A dropped entry points at block 0 of its pool, the
null block, which is never handed out: tables keep one entry per logical block, and
an attention path that masks keys outside the window reads there only keys it masks.

Pure Python (no torch): the runner sizes each group's tensors from ``num_blocks``.
Not covered here: prefix caching and forking samples (engine/core/kv_cache.py does
both for the one-group layout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .kv_cache import BlockPool, KVCacheBlock, blocks_needed
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
    between steps (a windowed group: its window and one token), and a group that holds
    less than the whole context a reserve for the step in flight: a request computing n tokens holds at most
    ceil((n - 1) / block_size) blocks more, so a step of ``max_step_tokens`` over at
    most ``max_num_seqs`` requests holds at most the reserve more in all."""
    held = [group.blocks_held(model_len, 1, block_size) for group in groups]
    reserve = [0 if count == blocks_needed(model_len, block_size) else
               blocks_needed(max_step_tokens, block_size) + max_num_seqs for count in held]
    per_request = sum(count * size for count, size in zip(held, group_block_bytes, strict=True))
    reserved = sum(count * size for count, size in zip(reserve, group_block_bytes, strict=True))
    num_requests = max(0, budget_bytes - reserved) / per_request
    return [math.floor(num_requests * count) + extra + 1 for count, extra in zip(held, reserve, strict=True)]


class WindowedBlockTables:
    """One table per group for each running request, over one pool per group."""

    def __init__(self, groups: Sequence[LayerGroup], num_blocks: Sequence[int], block_size: int) -> None:
        if len(groups) != len(num_blocks) or any(count < 2 for count in num_blocks) or block_size <= 0:
            raise ValueError(f"each of the {len(groups)} groups needs 2 or more blocks (one is the null "
                             f"block) and block_size must be positive, got {list(num_blocks)}, {block_size}")
        self.groups = tuple(groups)
        self.block_size = block_size
        self.pools = [BlockPool(count) for count in num_blocks]
        for pool in self.pools:
            (null,) = pool.allocate(1)  # the front of the free queue: block 0, held forever
            assert null.block_id == NULL_BLOCK_ID
        self._tables: dict[str, list[list[KVCacheBlock | None]]] = {}
        self._block_ids: dict[str, list[list[int]]] = {}
        self._num_dropped: dict[str, list[int]] = {}

    def num_free_blocks(self, group: int) -> int:
        return self.pools[group].num_free_blocks

    def live_block_ids(self, request_id: str, group: int) -> list[int]:
        """The request's table in ``group`` as block ids, extended and overwritten
        (dropped entries become NULL_BLOCK_ID) in place. Never modify it."""
        return self._block_ids[request_id][group]

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Drop the blocks that no query from request.num_computed_tokens on reads,
        then grow every table to cover ``num_new_tokens`` more tokens. Returns False
        (having dropped only blocks nobody reads) when a pool cannot supply its part."""
        request_id = request.request_id
        if request_id not in self._tables:
            self._tables[request_id] = [[] for _ in self.groups]
            self._block_ids[request_id] = [[] for _ in self.groups]
            self._num_dropped[request_id] = [0] * len(self.groups)
        self._drop_unread(request_id, request.num_computed_tokens)
        num_tokens = request.num_computed_tokens + num_new_tokens
        missing = [max(0, blocks_needed(num_tokens, self.block_size) - len(table))
                   for table in self._tables[request_id]]
        if any(count > pool.num_free_blocks for count, pool in zip(missing, self.pools, strict=True)):
            return False
        for group, count in enumerate(missing):
            added = self.pools[group].allocate(count)
            self._tables[request_id][group].extend(added)
            self._block_ids[request_id][group].extend(block.block_id for block in added)
        return True

    def free(self, request: Request) -> None:
        """Release every block the request holds (finish, abort or preemption)."""
        tables = self._tables.pop(request.request_id, None)
        if tables is None:
            return
        for pool, table in zip(self.pools, tables, strict=True):
            pool.release([block for block in reversed(table) if block is not None])
        del self._block_ids[request.request_id]
        del self._num_dropped[request.request_id]

    def _drop_unread(self, request_id: str, position: int) -> None:
        for group_index, group in enumerate(self.groups):
            num_unread = min(group.first_read(position) // self.block_size,
                             len(self._tables[request_id][group_index]))
            dropped = self._num_dropped[request_id][group_index]
            if num_unread <= dropped:
                continue
            table, block_ids = self._tables[request_id][group_index], self._block_ids[request_id][group_index]
            released = []
            for index in range(dropped, num_unread):
                block = table[index]
                assert block is not None
                released.append(block)
                table[index] = None
                block_ids[index] = NULL_BLOCK_ID
            self.pools[group_index].release(released)
            self._num_dropped[request_id][group_index] = num_unread
