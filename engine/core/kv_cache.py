"""Paged KV-cache bookkeeping: blocks, block tables, ref counts and prefix caching.

The model runner owns the tensors (per layer K and V of shape
[num_blocks, block_size, num_kv_heads, head_dim]); this module only decides which
block holds which token. Token position p of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

Invariants:
- A block is either owned (ref_cnt > 0, held by the block tables of ref_cnt running
  requests) or free (ref_cnt == 0, in the pool's LRU free queue). Never both.
- A block hash covers one FULL block and, through the chain, every token before it:
  hash_i = H(hash_{i-1}, tokens of block i, hashes of the images filling block i);
  block 0 folds in request.cache_salt. So a cached prefix is reused only for the same
  images: their placeholder tokens are the same whatever the image.
  ``cached_blocks`` maps each hash to at most one block and that block carries it.
- A free block keeps its hash until it is allocated again, so a later request with
  the same prefix can take it back ("touch") before the LRU queue reuses it.
- Hashes are registered only for blocks whose KV a finished step has written:
  tokens below request.num_computed_tokens at the request's next allocate_slots or
  at free. (vLLM registers at allocation, before the step runs; waiting one step
  costs a hit only to a request admitted in the very step that computes its
  prefix, and keeps a block from being shared before its KV exists, whatever order
  the runner writes and reads the cache in.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .block_pool import BlockHash, BlockPool, KVCacheBlock, blocks_needed, hash_block_tokens
from .partial_blocks import PartialBlocks
from .request import Request

# The blocks' own module (core/block_pool.py) is imported from here too.
__all__ = ["BlockHash", "BlockPool", "KVCacheBlock", "KVCacheManager", "PrefixCacheStats", "blocks_needed",
           "hash_block_tokens"]


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups committed at admission, counted in requests and tokens."""

    num_queries: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0  # copied tokens of partial hits included
    num_partial_hits: int = 0  # hits ending inside a block (core/partial_blocks.py)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class KVCacheManager:
    """Block tables of running requests over one BlockPool, with prefix caching.

    The scheduler asks ``get_computed_blocks`` for a waiting request's prefix hit (and
    ``partial_hit`` for the tokens of the next block some cached block holds, with
    ``partial_block_reuse``), commits it with ``allocate_slots(request, n, hit_blocks,
    num_copied_tokens)`` and grows the table
    with ``allocate_slots(request, n)`` every later step; ``free`` ends the request's
    hold on its blocks (finish, abort or preemption).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 partial_block_reuse: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive, got num_blocks={num_blocks}, "
                f"block_size={block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        if enable_prefix_caching and partial_block_reuse:
            self.pool.partial = PartialBlocks()
        self.stats = PrefixCacheStats()
        self._block_tables: dict[str, list[KVCacheBlock]] = {}
        # The same tables as block ids, extended in place as tables grow (read every step).
        self._block_ids: dict[str, list[int]] = {}
        # Chained hashes of a request's full blocks, extended as its tokens grow.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of a request's table have been offered to the cache.
        self._num_registered: dict[str, int] = {}
        # Per request: the smaller of the tokens its table covers and the computed tokens
        # from which its next full block is to be registered. While num_computed_tokens
        # plus the new tokens stay at or below it, allocate_slots has nothing to do.
        self._idle_below: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (empty when it holds none)."""
        return list(self._block_ids.get(request_id, ()))

    def live_block_ids(self, request_id: str) -> list[int]:
        """The request's block table itself, not a copy: later allocations extend this
        list in place, and a table rebuilt after free (preemption, a new request with
        the same id) is a new list, so a reader that keeps a copy of it can tell
        growth (same list, longer) from replacement (another list). Never modify it."""
        return self._block_ids[request_id]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks matching the request's prefix.

        Looks at most at request.num_tokens - 1 tokens: the last token is always
        computed, so the model yields logits. With recurrent-state snapshots (hybrid
        models) the hit ends at the last block whose state was saved, where the
        request's recurrent layers can continue. Returns (blocks, num_hit_tokens) and
        changes no cache state.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks = []
        num_usable = 0  # hit blocks ending where the request can continue
        snapshots = self.pool.snapshots
        for block_hash in self._request_block_hashes(request, max_hit_blocks):
            block = self.pool.cached_blocks.get(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
            if snapshots is None or snapshots.is_ready(block_hash):
                num_usable = len(hit_blocks)
        del hit_blocks[num_usable:]
        return hit_blocks, len(hit_blocks) * self.block_size

    def partial_hit(self, request: Request, num_hit_blocks: int) -> tuple[int, int]:
        """(block id, n): a block whose first n slots hold the KV of the first n tokens
        of the request's block after its ``num_hit_blocks`` hit blocks; (-1, 0) when
        none does or partial reuse is off. Changes no cache state."""
        partial = self.pool.partial
        if partial is None:
            return -1, 0
        return partial.lookup(request, num_hit_blocks, self._request_block_hashes(request, num_hit_blocks),
                              self.block_size)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_copied_tokens: int = 0,
    ) -> bool:
        """Grow the request's table to cover its computed tokens, the prefix hit being
        committed (``new_computed_blocks``, then ``num_copied_tokens`` of a partial hit,
        which the caller copies into the table's next block) and ``num_new_tokens`` more.

        Returns False and changes nothing when the free pool (less the cached free
        blocks the hit would revive) cannot supply the missing blocks.
        """
        request_id = request.request_id
        idle_below = self._idle_below.get(request_id)
        if idle_below is not None and request.num_computed_tokens + num_new_tokens <= idle_below \
                and not new_computed_blocks:
            return True  # the common decode step: the table covers it, nothing to register
        block_ids = self._block_ids.get(request_id)
        if block_ids is not None and not new_computed_blocks and \
                request.num_computed_tokens + num_new_tokens <= len(block_ids) * self.block_size:
            # The table covers the new tokens; a block may have filled since last time.
            self._register_computed(request)
            return True
        table = self._block_tables.get(request_id, [])
        assert not (table and new_computed_blocks), "prefix hits are committed only at admission"
        assert not (table and num_copied_tokens), "partial hits are committed only at admission"
        num_hit_tokens = len(new_computed_blocks) * self.block_size + num_copied_tokens
        num_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_missing = max(
            0, blocks_needed(num_tokens, self.block_size) - len(table) - len(new_computed_blocks)
        )
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_missing > self.pool.num_free_blocks - num_revived:
            return False

        if request_id not in self._block_tables:
            self._record_admission(request, num_hit_tokens, num_copied_tokens)
            self._num_registered[request_id] = len(new_computed_blocks)
        self.pool.touch(new_computed_blocks)
        added = [*new_computed_blocks, *self.pool.allocate(num_missing)]
        self._block_tables.setdefault(request_id, []).extend(added)
        self._block_ids.setdefault(request_id, []).extend(block.block_id for block in added)
        self._register_computed(request)
        self._note_idle_below(request_id)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks, caching its computed full blocks first.

        The table is released tail first, so the request's last blocks are the first
        of its blocks to be reused. Calling it for a request without blocks is a no-op.
        Call it only between steps: computed tokens must have their KV written (after
        a step that failed at run time, call ``reset_prefix_cache`` too).
        """
        request_id = request.request_id
        if request_id in self._block_tables:
            self._register_computed(request)
            self.pool.release(self._block_tables.pop(request_id)[::-1])
            del self._block_ids[request_id]
        self._block_hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self._idle_below.pop(request_id, None)

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give ``child`` (a sample sharing ``parent``'s tokens) the parent's KV.

        Full blocks are shared by reference count: nobody writes them again. The
        partially filled last block would be written by both, so the child gets a
        fresh block and the caller copies the KV (returned as (src, dst) block ids).
        Returns None when nothing needs copying; raises MemoryError when no block
        is free for the copy (nothing changed then).
        """
        table = self._block_tables[parent.request_id]
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        if partial and self.pool.num_free_blocks < 1:
            raise MemoryError("no free KV block to copy the partial block into")
        shared = table[:num_full]
        self.pool.touch(shared)
        copy = self.pool.allocate(1) if partial else []
        self._block_tables[child.request_id] = list(shared) + copy
        self._block_ids[child.request_id] = [block.block_id for block in self._block_tables[child.request_id]]
        self._num_registered[child.request_id] = 0
        self._note_idle_below(child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        return (table[num_full].block_id, copy[0].block_id) if partial else None

    def prefix_block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the full blocks a prefix hit of ``request`` could cover (all but
        its last token; as ``get_computed_blocks`` reads them). Empty without prefix caching."""
        if not self.enable_prefix_caching:
            return []
        return self._request_block_hashes(request, (request.num_tokens - 1) // self.block_size)

    def first_block_hash(self, request: Request) -> BlockHash | None:
        """The hash of the request's first block if a prefix hit could cover it, else None."""
        if not self.enable_prefix_caching or request.num_tokens - 1 < self.block_size:
            return None
        return self._request_block_hashes(request, 1)[0]

    def uncomputed_prompt_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the full prompt blocks a running request holds or will hold but has
        not cached yet (computed by this step or a later chunk). Empty for a request
        without blocks, one past its prompt, or without prefix caching."""
        num_registered = self._num_registered.get(request.request_id)
        num_prompt_blocks = request.num_prompt_tokens // self.block_size
        if not self.enable_prefix_caching or num_registered is None or num_registered >= num_prompt_blocks:
            return []
        return self._request_block_hashes(request, num_prompt_blocks)[num_registered:]

    def keep_resident(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Move the free ones among ``blocks`` to the end of the eviction queue, in the
        given order (the last is evicted last); held blocks are left as they are."""
        free_queue = self.pool.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                free_queue.move_to_end(block.block_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. after a failed step); returns how many."""
        return self.pool.reset()

    def _record_admission(self, request: Request, num_hit_tokens: int, num_copied_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.stats.num_queries += 1
            self.stats.num_query_tokens += request.num_tokens
            self.stats.num_hit_tokens += num_hit_tokens
            self.stats.num_partial_hits += num_copied_tokens > 0

    def _register_computed(self, request: Request) -> None:
        """Offer the request's full blocks below num_computed_tokens to the cache."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        table = self._block_tables[request_id]
        # A computed position may hold a pending token (async scheduling) not known yet.
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        num_full = min(num_full, len(table))
        num_registered = self._num_registered.get(request_id, 0)
        block_hashes = self._request_block_hashes(request, max(num_full, num_registered))
        if self.pool.partial is not None:
            num_computed = min(request.num_computed_tokens, request.num_tokens)
            self.pool.partial.record_request(request, self._block_ids[request_id], block_hashes, num_registered,
                                             num_computed, self.block_size)
        if num_full <= num_registered:
            return
        for index in range(num_registered, num_full):
            self.pool.register(table[index], block_hashes[index])
        self._num_registered[request_id] = num_full
        if request_id in self._idle_below:
            self._note_idle_below(request_id)

    def _note_idle_below(self, request_id: str) -> None:
        covered = len(self._block_ids[request_id]) * self.block_size
        if self.enable_prefix_caching:
            covered = min(covered, (self._num_registered[request_id] + 1) * self.block_size)
        self._idle_below[request_id] = covered

    def _request_block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first ``num_blocks`` full blocks (memoised per request)."""
        block_hashes = self._block_hashes.setdefault(request.request_id, [])
        size = self.block_size
        assert num_blocks * size <= request.num_tokens, (num_blocks, request.num_tokens)
        while len(block_hashes) < num_blocks:
            index = len(block_hashes)
            parent = block_hashes[-1] if block_hashes else None
            tokens = request.token_ids_slice(index * size, (index + 1) * size)
            images = request.image_hashes_in(index * size, (index + 1) * size) if request.images else ()
            block_hashes.append(hash_block_tokens(parent, tokens, request.cache_salt, images))
        return block_hashes[:num_blocks]
