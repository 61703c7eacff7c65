"""Recurrent-state slots: the scheduler gives every running request of a hybrid model
one slot and takes it back at finish, abort and preemption; forks take a slot or
wait; the planner holds slots beside KV blocks and refuses a budget that holds not
even one request."""

from __future__ import annotations

import random

import pytest
import torch

from shardline.engine.config import EngineConfig
from shardline.engine.core.request import RequestStatus
from shardline.engine.core.state_slots import StateSlots
from shardline.engine.model.kv_cache_spec import KVCacheSpec, LayerCacheSpec
from shardline.engine.model.runner import plan_kv_cache
from shardline.engine.recurrent.state import RecurrentStateSpec

from ..core.test_scheduler import make_requests, make_scheduler


def _check_slots(scheduler) -> None:
    """Exactly the running requests own a slot, each its own."""
    slots = scheduler.state_slots
    owned = [slots.slot_of(r.request_id) for r in scheduler.running]
    assert None not in owned and len(set(owned)) == len(owned)
    assert slots.num_free == slots.num_slots - len(owned)
    assert all(slots.slot_of(r.request_id) is None for r in scheduler.waiting)


def test_slots_are_taken_and_given_back():
    slots = StateSlots(2)
    assert slots.allocate("a") == 0 and slots.allocate("a") == 0 and slots.allocate("b") == 1
    assert slots.allocate("c") is None
    slots.free("a")
    assert slots.allocate("c") == 0 and slots.num_free == 0
    slots.free("unknown")


def test_random_workload_keeps_one_slot_per_running_request():
    """Admission, chunked prefill, preemption (a small cache) and finish, checked each step."""
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=10, max_model_len=40, num_state_slots=3, max_num_seqs=3,
                               enable_prefix_caching=False)
    requests = make_requests(10, prompt_len=9, max_tokens=6)
    for request in requests:
        scheduler.add_request(request)
    preempted = 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        preempted += len(output.preempted)
        for item in output.scheduled:
            assert item.state_slot == scheduler.state_slot(item.request.request_id) >= 0
        for item in output.scheduled:
            if item.is_last_chunk:
                item.request.append_output_token(rng.randrange(100))
                if item.request.num_output_tokens >= item.request.max_tokens:
                    scheduler.finish_requests(item.request.request_id, RequestStatus.FINISHED_LENGTH)
        _check_slots(scheduler)
    assert preempted > 0 and scheduler.state_slots.num_free == 3


def test_a_fork_without_a_free_slot_waits_and_recomputes():
    scheduler = make_scheduler(num_state_slots=1, max_num_seqs=1, enable_prefix_caching=False)
    parent, child = make_requests(2, prompt_len=5, start_index=20)
    scheduler.add_request(parent)
    scheduler.schedule()
    assert scheduler.fork_request(parent, child) is None
    assert child.status is RequestStatus.WAITING and scheduler.state_slot(child.request_id) is None
    scheduler.finish_requests([parent.request_id, child.request_id], RequestStatus.FINISHED_ABORTED)
    assert scheduler.state_slots.num_free == 1


def _specs(state_bytes: int) -> tuple[KVCacheSpec, RecurrentStateSpec]:
    kv = KVCacheSpec((LayerCacheSpec("full", 2, 4, 4), LayerCacheSpec("recurrent", 0, 0, 0)), torch.float32)
    state = RecurrentStateSpec({1: {"state": ((state_bytes // 4,), torch.float32)}})
    return kv, state


def test_the_planner_holds_slots_beside_blocks():
    kv, state = _specs(4096)
    per_block = kv.bytes_per_block(16)  # 16 tokens x 2 heads x (4 + 4) x 4 bytes
    config = EngineConfig(model="unused", max_num_seqs=8, block_size=16)
    # One request of 64 tokens needs 5 blocks; 3 slots fit beside them.
    num_blocks, num_slots = plan_kv_cache(config, kv, 64, 5 * per_block + 3 * 4096 + 100, state)
    assert (num_slots, num_blocks) == (3, 5)
    num_blocks, num_slots = plan_kv_cache(config, kv, 64, 10**9, state)
    assert num_slots == 8 and num_blocks == 8 * 4 + 1
    with pytest.raises(ValueError, match=r"cannot hold one request: its recurrent state takes 4096 bytes"):
        plan_kv_cache(config, kv, 64, 5 * per_block + 4000, state)
