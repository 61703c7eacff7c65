"""KVCacheManager: block tables, ref counts, prefix caching and the LRU free queue."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from shardline.engine.core.kv_cache import KVCacheManager, blocks_needed, hash_block_tokens
from shardline.engine.core.request import Request

BLOCK_SIZE = 4


def make_manager(num_blocks: int = 8, enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)


def make_request(request_id: str, token_ids: list[int], cache_salt=None) -> Request:
    return Request(request_id, list(token_ids), max_tokens=4, cache_salt=cache_salt)


def run_prefill(manager: KVCacheManager, request: Request) -> None:
    """Admit ``request`` (committing any prefix hit) and compute its whole prompt."""
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hit_blocks)
    request.num_computed_tokens = request.num_tokens


def snapshot(manager: KVCacheManager) -> tuple:
    pool = manager.pool
    return (
        list(pool.free_queue),
        {h: b.block_id for h, b in pool.cached_blocks.items()},
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {rid: manager.get_block_ids(rid) for rid in ("a", "b", "c")},
        dataclasses.astuple(manager.stats),
    )


def test_blocks_needed_rounds_up():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_table_and_keeps_its_prefix():
    manager = make_manager()
    request = make_request("a", range(10))
    assert manager.allocate_slots(request, 10)
    table = manager.get_block_ids("a")
    assert len(table) == 3 and manager.num_free_blocks == 5
    assert manager.usage == 3 / 8
    request.num_computed_tokens = 10
    request.append_output_token(99)
    assert manager.allocate_slots(request, 1)  # token 11 still fits block 3
    assert manager.get_block_ids("a") == table
    request.num_computed_tokens = 11
    request.append_output_token(98)
    request.append_output_token(97)
    assert manager.allocate_slots(request, 2)  # tokens 12-13 need a fourth block
    assert manager.get_block_ids("a")[:3] == table and len(manager.get_block_ids("a")) == 4


def test_allocate_failure_changes_nothing():
    manager = make_manager(num_blocks=5)
    first = make_request("a", range(8))
    run_prefill(manager, first)
    manager.free(first)  # two cached blocks now sit in the free queue
    holder = make_request("c", range(100, 104))
    assert manager.allocate_slots(holder, 4)
    # Hits the two cached blocks and needs three more: 4 blocks are free, but reviving
    # the two cached ones leaves only 2, so this must fail.
    second = make_request("b", list(range(8)) + list(range(200, 209)))
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 8
    before = snapshot(manager)
    assert not manager.allocate_slots(second, second.num_tokens - num_hit_tokens, hit_blocks)
    assert snapshot(manager) == before
    assert not manager.allocate_slots(make_request("b", range(300, 321)), 21)
    assert snapshot(manager) == before


def test_prefix_hit_covers_full_blocks_and_leaves_one_token_to_compute():
    manager = make_manager()
    run_prefill(manager, first := make_request("a", range(10)))
    manager.free(first)
    blocks, num_hit_tokens = manager.get_computed_blocks(make_request("b", range(11)))
    assert num_hit_tokens == 8 and [b.block_id for b in blocks] == [0, 1]
    # Same 8 tokens exactly: the last one must still be computed, so only one block hits.
    assert manager.get_computed_blocks(make_request("c", range(8)))[1] == 4
    assert manager.get_computed_blocks(make_request("d", [5] + list(range(1, 10))))[1] == 0


def test_blocks_are_cached_only_once_their_kv_is_computed():
    manager = make_manager()
    running = make_request("a", range(9))
    assert manager.allocate_slots(running, 9)
    # Allocated but not computed yet: no block may be shared.
    assert manager.get_computed_blocks(make_request("b", range(9)))[1] == 0
    running.num_computed_tokens = 9  # the step ran
    running.append_output_token(7)
    assert manager.allocate_slots(running, 1)  # next step registers the computed blocks
    assert manager.get_computed_blocks(make_request("b", range(9)))[1] == 8


def test_block_hash_chains_over_the_prefix():
    block = [1, 2, 3, 4]
    assert hash_block_tokens(hash_block_tokens(None, [0] * 4), block) != hash_block_tokens(
        hash_block_tokens(None, [9] * 4), block
    )
    manager = make_manager()
    run_prefill(manager, first := make_request("a", [0, 0, 0, 0] + block + [5]))
    manager.free(first)
    # Block 1 has the same content but a different block 0: nothing matches.
    assert manager.get_computed_blocks(make_request("b", [9, 9, 9, 9] + block + [5]))[1] == 0
    # The match stops at the first differing block even if a later one is identical.
    hit = manager.get_computed_blocks(make_request("c", [0, 0, 0, 0] + [7, 7, 7, 7] + [5]))
    assert hit[1] == 4


def test_block_hash_is_stable_across_processes():
    code = (
        "from shardline.engine.core.kv_cache import hash_block_tokens;"
        "print(hash_block_tokens(None, [1, 2, 3, 4], 'lora-a').hex())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert digests == {hash_block_tokens(None, [1, 2, 3, 4], "lora-a").hex() + "\n"}


def test_cache_salt_separates_entries():
    manager = make_manager()
    run_prefill(manager, first := make_request("a", range(9), cache_salt="lora-a"))
    manager.free(first)
    assert manager.get_computed_blocks(make_request("b", range(9), cache_salt="lora-b"))[1] == 0
    assert manager.get_computed_blocks(make_request("c", range(9)))[1] == 0
    assert manager.get_computed_blocks(make_request("d", range(9), cache_salt="lora-a"))[1] == 8


def test_shared_blocks_are_ref_counted():
    manager = make_manager()
    first = make_request("a", range(9))
    run_prefill(manager, first)
    first.append_output_token(50)
    assert manager.allocate_slots(first, 1)
    second = make_request("b", list(range(8)) + [60, 61])
    run_prefill(manager, second)
    shared = manager.pool.blocks[:2]
    assert manager.get_block_ids("b")[:2] == [0, 1] and [b.ref_cnt for b in shared] == [2, 2]
    assert manager.num_free_blocks == 8 - 3 - 1
    manager.free(first)
    assert [b.ref_cnt for b in shared] == [1, 1]
    assert all(b.block_id not in manager.pool.free_queue for b in shared)
    manager.free(second)
    assert [b.ref_cnt for b in shared] == [0, 0] and manager.num_free_blocks == 8


def test_identical_blocks_are_registered_once():
    manager = make_manager()
    first, second = make_request("a", range(9)), make_request("b", range(9))
    for request in (first, second):  # both computed before either was cached
        assert manager.allocate_slots(request, 9)
        request.num_computed_tokens = 9
    manager.free(first)
    manager.free(second)
    assert len(manager.pool.cached_blocks) == 2
    blocks, _ = manager.get_computed_blocks(make_request("c", range(9)))
    assert [b.block_id for b in blocks] == [0, 1]
    assert [b.block_hash for b in manager.pool.blocks[3:6]] == [None] * 3


def test_freed_blocks_are_reused_tail_first_and_lru():
    manager = make_manager(num_blocks=6)
    first = make_request("a", range(12))  # blocks 0-2
    second = make_request("b", range(100, 112))  # blocks 3-5
    run_prefill(manager, first)
    run_prefill(manager, second)
    manager.free(first)
    manager.free(second)
    # Free queue: a's blocks tail first, then b's.
    assert list(manager.pool.free_queue) == [2, 1, 0, 5, 4, 3]
    # A hit on a's prefix makes its blocks the most recently used.
    again = make_request("a2", range(12))
    run_prefill(manager, again)
    manager.free(again)
    assert list(manager.pool.free_queue)[:3] == [5, 4, 3]
    filler = make_request("c", range(200, 204))
    assert manager.allocate_slots(filler, 4)
    assert manager.get_block_ids("c") == [5]
    assert manager.get_computed_blocks(make_request("b2", range(100, 113)))[1] == 8
    assert manager.get_computed_blocks(make_request("a3", range(13)))[1] == 12


def test_reset_prefix_cache_forgets_every_hash():
    manager = make_manager()
    run_prefill(manager, first := make_request("a", range(9)))
    manager.free(first)
    assert manager.reset_prefix_cache() == 2
    assert manager.get_computed_blocks(make_request("b", range(9)))[1] == 0
    assert all(block.block_hash is None for block in manager.pool.blocks)
    assert manager.num_free_blocks == 8


def test_stats_count_committed_lookups_in_tokens():
    manager = make_manager()
    run_prefill(manager, first := make_request("a", range(9)))
    manager.free(first)
    run_prefill(manager, make_request("b", range(10)))
    assert (manager.stats.num_queries, manager.stats.num_query_tokens) == (2, 19)
    assert manager.stats.num_hit_tokens == 8 and manager.stats.hit_rate == 8 / 19


def test_disabled_prefix_caching_never_hits():
    manager = make_manager(enable_prefix_caching=False)
    run_prefill(manager, first := make_request("a", range(9)))
    manager.free(first)
    assert manager.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    assert not manager.pool.cached_blocks and manager.stats.num_queries == 0


def test_free_is_idempotent_and_ignores_requests_without_blocks():
    manager = make_manager()
    request = make_request("a", range(5))
    manager.free(request)
    assert manager.allocate_slots(request, 5)
    manager.free(request)
    manager.free(request)
    assert manager.num_free_blocks == 8 and manager.get_block_ids("a") == []
