"""WindowedBlockTables: per-group tables where windowed groups drop the blocks no later
query reads, and the byte budget split between groups."""

from __future__ import annotations

import random

import pytest

from shardline.engine.core.kv_cache import KVCacheManager, blocks_needed
from shardline.engine.core.request import Request
from shardline.engine.core.window_blocks import (
    CHUNKED,
    FULL,
    NULL_BLOCK_ID,
    SLIDING,
    LayerGroup,
    WindowedBlockTables,
    layer_groups,
    split_budget,
)

BLOCK_SIZE = 4


def keys_read(group: LayerGroup, query: int) -> range:
    """Key positions a query at ``query`` reads, written from each kind's definition."""
    if group.kind == SLIDING:
        assert group.span is not None
        return range(max(0, query - group.span + 1), query + 1)
    if group.kind == CHUNKED:
        assert group.span is not None
        return range(query - query % group.span, query + 1)
    return range(0, query + 1)


def test_layer_groups_by_kind_and_span() -> None:
    groups = layer_groups([(SLIDING, 8), (FULL, None), (SLIDING, 8), (CHUNKED, 16), (FULL, None)])
    assert [(group.kind, group.span, group.layers) for group in groups] == [
        (SLIDING, 8, (0, 2)), (FULL, None, (1, 4)), (CHUNKED, 16, (3,))]
    with pytest.raises(ValueError, match="layer 1: kind 'recurrent'"):
        layer_groups([(FULL, None), ("recurrent", None)])
    with pytest.raises(ValueError, match="layer 0: a sliding_window layer needs a positive window"):
        layer_groups([(SLIDING, None)])


@pytest.mark.parametrize("seed", range(6))
def test_every_read_key_is_held_and_every_dropped_block_is_never_read(seed: int) -> None:
    rng = random.Random(seed)
    groups = layer_groups([(SLIDING, rng.choice([3, 4, 9, 16])), (FULL, None), (CHUNKED, rng.choice([4, 8, 12]))])
    tables = WindowedBlockTables(groups, [200, 200, 200], BLOCK_SIZE)
    request = Request("r", list(range(rng.randint(30, 90))), max_tokens=1)
    while request.num_computed_tokens < request.num_tokens:
        start = request.num_computed_tokens
        new = min(rng.randint(1, 11), request.num_tokens - start)
        assert tables.allocate_slots(request, new)
        for index, group in enumerate(groups):
            block_ids = tables.live_block_ids("r", index)
            assert len(block_ids) == blocks_needed(start + new, BLOCK_SIZE)
            read = {key // BLOCK_SIZE for query in range(start, start + new) for key in keys_read(group, query)}
            later = {key // BLOCK_SIZE for query in range(start, start + 200) for key in keys_read(group, query)}
            held = {block for block, block_id in enumerate(block_ids) if block_id != NULL_BLOCK_ID}
            assert read <= held
            assert held - {block for block in range(len(block_ids)) if block in later} == set()
            assert len(set(block_ids) - {NULL_BLOCK_ID}) == len(held)  # no block twice
        request.num_computed_tokens += new
    held_full = 200 - 1 - tables.num_free_blocks(1)
    assert held_full == blocks_needed(request.num_tokens, BLOCK_SIZE)
    tables.free(request)
    assert [tables.num_free_blocks(group) for group in range(3)] == [199, 199, 199]


def test_sliding_group_holds_the_window_and_full_group_everything() -> None:
    groups = layer_groups([(SLIDING, 8), (FULL, None)])
    tables = WindowedBlockTables(groups, [100, 100], BLOCK_SIZE)
    request = Request("r", list(range(64)), max_tokens=1)
    for _ in range(16):  # a prompt of 64 tokens computed 4 at a time
        assert tables.allocate_slots(request, 4)
        request.num_computed_tokens += 4
    assert tables.allocate_slots(request, 1)  # the first decode step, at position 64
    sliding, full = tables.live_block_ids("r", 0), tables.live_block_ids("r", 1)
    # Position 64 reads keys 57..64: blocks 14, 15 and 16 (positions 56..67).
    assert [index for index, block_id in enumerate(sliding) if block_id != NULL_BLOCK_ID] == [14, 15, 16]
    assert NULL_BLOCK_ID not in full and len(full) == 17
    assert (tables.num_free_blocks(0), tables.num_free_blocks(1)) == (99 - 3, 99 - 17)


def test_a_pool_short_of_blocks_refuses_and_allocates_nothing() -> None:
    groups = layer_groups([(SLIDING, 4), (FULL, None)])
    tables = WindowedBlockTables(groups, [50, 5], BLOCK_SIZE)
    first, second = Request("a", list(range(16)), max_tokens=1), Request("b", list(range(16)), max_tokens=1)
    assert tables.allocate_slots(first, 16)
    assert not tables.allocate_slots(second, 4)  # the full pool has no block left
    assert (tables.num_free_blocks(0), tables.num_free_blocks(1)) == (49 - 4, 0)
    tables.free(first)
    assert tables.allocate_slots(second, 4)


def count_resident(allocate, model_len: int, chunk: int) -> int:
    """Requests of model_len tokens prefilled chunk by chunk, each then taking its first
    decode slot, none finishing, until one is refused."""
    admitted = 0
    while True:
        request = Request(str(admitted), list(range(model_len)), max_tokens=1)
        while request.num_computed_tokens < model_len and allocate(request, chunk):
            request.num_computed_tokens += chunk
        if request.num_computed_tokens < model_len or not allocate(request, 1):
            return admitted
        admitted += 1


def test_split_budget_holds_more_requests_than_one_table_for_all_layers() -> None:
    groups = layer_groups([(SLIDING, 64)] * 5 + [(FULL, None)])
    model_len, chunk, layer_block = 1024, 64, 100
    budget = 6 * layer_block * blocks_needed(model_len + 1, BLOCK_SIZE) * 10
    one_table = KVCacheManager(budget // (6 * layer_block), BLOCK_SIZE, enable_prefix_caching=False)
    assert count_resident(one_table.allocate_slots, model_len, chunk) == 10
    num_blocks = split_budget(groups, [5 * layer_block, layer_block], budget, BLOCK_SIZE, model_len, chunk, 1)
    assert num_blocks[0] * 5 * layer_block + num_blocks[1] * layer_block <= budget + 6 * layer_block
    tables = WindowedBlockTables(groups, num_blocks, BLOCK_SIZE)
    # Per request 257 full blocks and 17 of each sliding layer, against 6 * 257.
    assert count_resident(tables.allocate_slots, model_len, chunk) >= 40
