"""Token-granular prefix hits: the longest run of a block's first tokens already in the cache.

Prefix caching by block hash reuses whole blocks only. A shared prefix that ends
inside a block (a template followed by each row's own tail) leaves the next
request's block hashing differently from every cached one, though its first tokens
have the same keys and values as those of a block computed before. This index
keeps, for every block whose leading tokens hold valid KV, those tokens and the key
of the chain before the block (its parent block's hash, or the cache salt for a
first block); a request whose full-block hit ends at block i looks among the blocks
with its block i's parent key for the longest run of its own tokens, and the
scheduler copies that many slots into the request's fresh block instead of
computing them (core/scheduler.py, model/runner.py ``copy_block_prefixes``).

A per-block token list, not a token trie: the blocks that share a parent are few
(a template's rows share its full blocks by reference, so only the divergent block
has one entry per computed tail), candidates are bucketed by their first token, and
a lookup runs only when a request is admitted.

Invariants:
- An entry (block id -> parent key, tokens) says the block's first len(tokens) slots
  hold the KV of those tokens after that parent chain. Entries are recorded only for
  tokens a finished (or earlier queued) step has written, and a block's owner only
  ever writes later slots, so an entry stays true until the block is allocated again
  or the cache is reset, which drop it (core/kv_cache.py BlockPool).
- A block touching an image is keyed position by position: a token where the prompt
  has text, (image hash, encoder row) where an image fills it. A hit over an image's
  positions therefore needs the same image's same rows at the same positions (after
  the same parent chain), whose KV is the same: the encoder output is a function of
  the image's hash, and everything before them is the parent chain and the tokens
  and rows matched before them. Rows a hit covers need no encoder output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .request import Request

ParentKey = bytes
# What must match at one position: its token id, or (image hash, encoder row) where an
# image fills it.
PositionKey = int | tuple[str, int]


def parent_key(parent_hash: bytes | None, cache_salt: object) -> ParentKey:
    """What must match before a block for its leading tokens' KV to be reusable: the
    hash of the chain before it, or for a first block the request's cache salt (a
    value with a stable repr, as core/kv_cache.py hashes it)."""
    if parent_hash is not None:
        return b"P" + parent_hash
    return b"R" + repr(cache_salt).encode()


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A step copies slots [0, num_tokens) of block ``src_block`` into block ``dst_block``
    in every layer's cache before its forward (a request's token-granular prefix hit)."""

    src_block: int
    dst_block: int
    num_tokens: int


class PartialBlocks:
    """Blocks by parent key and first token, each with the tokens whose KV it holds."""

    def __init__(self) -> None:
        # parent key -> first position's key -> block id -> the keys of its valid positions
        self._buckets: dict[ParentKey, dict[PositionKey, dict[int, tuple[PositionKey, ...]]]] = {}
        self._where: dict[int, tuple[ParentKey, PositionKey]] = {}  # block id -> its bucket

    def __len__(self) -> int:
        return len(self._where)

    def record(self, block_id: int, key: ParentKey, token_ids: Sequence[PositionKey]) -> None:
        """The block's first len(token_ids) slots hold the KV of these positions (tokens,
        or image rows) after ``key``'s chain (replacing what was recorded for the block
        before)."""
        if not token_ids:
            return
        bucket_key = (key, token_ids[0])
        if self._where.get(block_id) != bucket_key:
            self.drop(block_id)
            self._where[block_id] = bucket_key
        self._buckets.setdefault(key, {}).setdefault(token_ids[0], {})[block_id] = tuple(token_ids)

    def drop(self, block_id: int) -> None:
        """Forget the block (it is being allocated to hold other tokens)."""
        where = self._where.pop(block_id, None)
        if where is None:
            return
        key, first = where
        by_first = self._buckets[key]
        blocks = by_first[first]
        del blocks[block_id]
        if not blocks:
            del by_first[first]
            if not by_first:
                del self._buckets[key]

    def clear(self) -> None:
        self._buckets.clear()
        self._where.clear()

    def record_request(self, request: Request, block_ids: Sequence[int], block_hashes: Sequence[bytes],
                       first_block: int, num_computed: int, block_size: int) -> None:
        """Record the request's blocks from ``first_block`` on up to its first
        ``num_computed`` tokens (written KV): full blocks whole, the last one in part.
        ``block_hashes`` covers every full block before the last one recorded."""
        last_block = min(-(-num_computed // block_size), len(block_ids))
        for index in range(first_block, last_block):
            start = index * block_size
            end = min(start + block_size, num_computed)
            key = parent_key(block_hashes[index - 1] if index else None, request.cache_salt)
            self.record(block_ids[index], key, position_keys(request, start, end))

    def lookup(self, request: Request, num_hit_blocks: int, block_hashes: Sequence[bytes],
               block_size: int) -> tuple[int, int]:
        """(block id, n): a block holding the KV of the first n tokens of the request's
        block ``num_hit_blocks`` (the one after its full-block hit), looking at most up
        to its last token, which is always computed; (-1, 0) when there is none.
        ``block_hashes``: the hashes of the request's first ``num_hit_blocks`` blocks."""
        start = num_hit_blocks * block_size
        end = min(start + block_size, request.num_tokens - 1)
        if end <= start:
            return -1, 0
        key = parent_key(block_hashes[num_hit_blocks - 1] if num_hit_blocks else None, request.cache_salt)
        return self.longest(key, position_keys(request, start, end))

    def longest(self, key: ParentKey, token_ids: Sequence[PositionKey]) -> tuple[int, int]:
        """(block id, n): the block holding the longest run of ``token_ids``' first n
        tokens after ``key``'s chain; (-1, 0) when no block starts with token_ids[0]."""
        if not token_ids:
            return -1, 0
        candidates = self._buckets.get(key, {}).get(token_ids[0])
        if not candidates:
            return -1, 0
        best_block, best = -1, 0
        for block_id, cached in candidates.items():
            num_common = _common_prefix_len(cached, token_ids)
            if num_common > best:
                best_block, best = block_id, num_common
                if best == len(token_ids):
                    break
        return best_block, best


def position_keys(request: Request, start: int, end: int) -> list[PositionKey]:
    """The keys of positions [start, end) of the request: token ids, with each position
    an image fills replaced by (its hash, its encoder row)."""
    keys: list[PositionKey] = list(request.token_ids_slice(start, end))
    for image in request.images:
        if image.start >= end or image.end <= start:
            continue
        first, last = image.rows_in(start, end)
        for row in range(first, last):
            keys[image.positions[row] - start] = (image.image_hash, row)
    return keys


def _common_prefix_len(a: Sequence[PositionKey], b: Sequence[PositionKey]) -> int:
    num_common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        num_common += 1
    return num_common
