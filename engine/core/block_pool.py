"""The physical blocks of the paged KV cache and their hashes: a block's id, reference
count and hash, the pool with its LRU queue of free blocks and its hash -> block map,
and the chained digest that names a full block's contents (core/kv_cache.py's
invariants say when a hash is registered)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from .partial_blocks import PartialBlocks
from .request import CacheSalt
from .state_slots import StateSnapshots

BlockHash = bytes


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], cache_salt: CacheSalt | None = None,
    image_hashes: Sequence[str] = (),
) -> BlockHash:
    """Stable digest of one full block chained to the hash of the block before it.

    ``cache_salt`` is folded in only for the first block (``parent_hash`` None); the
    chain carries it to every later block. It must have a stable ``repr`` (str, int,
    tuple of those), since Python's own ``hash`` of a str changes per process.
    """
    hasher = hashlib.blake2b(digest_size=16)
    if parent_hash is None:
        salt = repr(cache_salt).encode()
        hasher.update(b"R" + len(salt).to_bytes(8, "little") + salt)
    else:
        hasher.update(b"P" + parent_hash)
    hasher.update(array("q", token_ids).tobytes())
    for image_hash in image_hashes:
        hasher.update(b"I" + image_hash.encode())
    return hasher.digest()


class KVCacheBlock:
    """One physical KV block: its id, how many block tables hold it, its hash if cached."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={cached})"


class BlockPool:
    """All blocks, the LRU queue of free ones and the hash -> block map of cached ones.

    The free queue is ordered least recently freed first: allocation takes from the
    front, release appends to the tail, and a prefix hit removes a block from the
    middle in O(1) (an OrderedDict keyed by block id).
    """

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks
        )
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Recurrent-state snapshots by block hash (hybrid models), dropped with their hash.
        self.snapshots: StateSnapshots | None = None
        # Blocks' leading tokens for token-granular hits, dropped when a block is allocated.
        self.partial: PartialBlocks | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the front of the free queue, evicting their hashes."""
        assert num_blocks <= len(self.free_queue), (num_blocks, len(self.free_queue))
        allocated = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            if self.partial is not None:
                self.partial.drop(block.block_id)
            block.ref_cnt = 1
            allocated.append(block)
        return allocated

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on cached blocks, reviving free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop a reference on each block, in order; a block at zero joins the tail."""
        for block in blocks:
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def register(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Make ``block`` findable by ``block_hash`` unless another block already is."""
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def reset(self) -> int:
        """Forget every hash; returns how many were dropped."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        if self.snapshots is not None:
            self.snapshots.reset()
        if self.partial is not None:
            self.partial.clear()
        num_dropped = len(self.cached_blocks)
        self.cached_blocks.clear()
        return num_dropped

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            assert self.cached_blocks.get(block.block_hash) is block, block
            del self.cached_blocks[block.block_hash]
            if self.snapshots is not None:
                self.snapshots.drop(block.block_hash)
            block.block_hash = None
