"""Recurrent-state snapshots (core/state_slots.py StateSnapshots) with the KV cache and
scheduler: hits end at a saved state, snapshots leave with their block's hash, a step
never saves two states into one slot, and a shared boundary ends a prompt chunk."""

from __future__ import annotations

from shardline.engine.core.kv_cache import KVCacheManager
from shardline.engine.core.request import Request
from shardline.engine.core.scheduler import Scheduler, SchedulerConfig
from shardline.engine.core.state_slots import StateSnapshots

BLOCK = 4


def _cache_with_snapshots(num_blocks: int, num_snapshots: int) -> tuple[KVCacheManager, StateSnapshots]:
    kv_cache = KVCacheManager(num_blocks, BLOCK)
    snapshots = StateSnapshots(first_slot=2, num_snapshots=num_snapshots)
    kv_cache.pool.snapshots = snapshots
    return kv_cache, snapshots


def _compute(kv_cache: KVCacheManager, request: Request) -> None:
    """Give the request blocks for its prompt, mark it computed and cache its blocks."""
    assert kv_cache.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv_cache.free(request)


def test_a_hit_ends_at_the_last_block_with_a_saved_state():
    kv_cache, snapshots = _cache_with_snapshots(num_blocks=8, num_snapshots=2)
    _compute(kv_cache, Request("a", list(range(13)), max_tokens=1))
    probe = Request("b", list(range(13)) + [99], max_tokens=1)
    assert kv_cache.get_computed_blocks(probe)[1] == 0  # blocks cached, no state saved
    hashes = kv_cache.prefix_block_hashes(probe)
    snapshots.claim(hashes[1])
    assert kv_cache.get_computed_blocks(probe)[1] == 0  # being saved by this step: not yet
    snapshots.begin_step()
    assert kv_cache.get_computed_blocks(probe)[1] == 2 * BLOCK
    snapshots.claim(hashes[2])
    snapshots.begin_step()
    assert kv_cache.get_computed_blocks(probe)[1] == 3 * BLOCK


def test_a_snapshot_leaves_with_its_blocks_hash_and_on_reset():
    kv_cache, snapshots = _cache_with_snapshots(num_blocks=4, num_snapshots=2)
    request = Request("a", list(range(9)), max_tokens=1)
    _compute(kv_cache, request)
    hashes = kv_cache.prefix_block_hashes(Request("p", list(range(9)), max_tokens=1))
    slot = snapshots.claim(hashes[0])
    assert slot is not None and snapshots.slot_of(hashes[0]) == slot
    _compute(kv_cache, Request("c", list(range(100, 116)), max_tokens=1))  # evicts every cached block
    assert snapshots.slot_of(hashes[0]) is None
    snapshots.claim(hashes[1])
    kv_cache.reset_prefix_cache()
    assert snapshots.slot_of(hashes[1]) is None


def test_a_step_never_claims_one_slot_twice():
    snapshots = StateSnapshots(first_slot=3, num_snapshots=2)
    snapshots.begin_step()
    assert {snapshots.claim(b"a"), snapshots.claim(b"b")} == {3, 4}
    assert snapshots.claim(b"c") is None  # the least recently used was claimed in this step
    snapshots.begin_step()
    assert snapshots.claim(b"c") is not None and snapshots.slot_of(b"a") is None


def test_a_shared_boundary_ends_the_chunk_and_the_next_request_restores_it():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32,
                                          block_size=BLOCK, num_blocks=16, num_state_slots=2, num_state_snapshots=2,
                                          prefix_aware_admission=False))
    shared = list(range(10, 19))  # two full blocks and one token
    first, second = Request("a", shared + [1, 2], max_tokens=1), Request("b", shared + [3], max_tokens=1)
    scheduler.add_request(first)
    step = scheduler.schedule()
    assert [item.num_new_tokens for item in step.scheduled] == [11]  # nobody else wants the blocks yet
    scheduler.finish_requests("a", first.status.FINISHED_ABORTED)
    first = Request("a2", shared + [1, 2], max_tokens=1)
    scheduler.add_request(first)
    scheduler.add_request(second)
    step = scheduler.schedule()
    (item_a, item_b) = step.scheduled
    assert (item_a.num_new_tokens, item_a.save_slot >= 0) == (2 * BLOCK, True)
    assert item_b.save_slot == -1 and item_b.restore_slot == -1  # the state is being saved this step
    step = scheduler.schedule()  # the blocks are registered now
    scheduler.finish_requests("b", first.status.FINISHED_ABORTED)
    third = Request("c", shared + [4, 5], max_tokens=1)
    scheduler.add_request(third)
    step = scheduler.schedule()
    (item_c,) = [item for item in step.scheduled if item.request is third]
    assert (item_c.start, item_c.restore_slot) == (2 * BLOCK, item_a.save_slot)
