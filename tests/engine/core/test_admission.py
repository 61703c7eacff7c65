"""Prefix-aware admission (core/admission.py): grouping, priority, the age bound, resident prefixes."""

from __future__ import annotations

import random

import pytest

from shardline.engine.core.admission import PrefixAwareAdmission
from shardline.engine.core.kv_cache import KVCacheManager
from shardline.engine.core.request import Request, RequestStatus

from .test_scheduler import KVTracker, make_scheduler, run_to_completion, step


def template_requests(templates: list[list[int]], picks: list[int], tail_len: int = 2,
                      max_tokens: int = 2, priorities: list[int] | None = None) -> list[Request]:
    """One request per pick: templates[pick] followed by a tail of its own."""
    requests = []
    for index, pick in enumerate(picks):
        tail = [5000 + index * 10 + k for k in range(tail_len)]
        priority = priorities[index] if priorities else 0
        requests.append(Request(f"r{index}", templates[pick] + tail, max_tokens, priority=priority,
                                arrival_index=index))
    return requests


def computed_prompt_tokens(outputs) -> int:
    """Prompt tokens the steps computed (prefix hits excluded)."""
    return sum(min(s.start + s.num_new_tokens, s.request.num_prompt_tokens) - s.start
               for output in outputs for s in output.scheduled if s.start < s.request.num_prompt_tokens)


def test_a_group_sharing_a_prefix_computes_it_once():
    templates = [list(range(100, 116)), list(range(200, 216))]
    picks = [0, 1, 0, 1, 0, 1]
    scheduler = make_scheduler(max_num_seqs=8, max_num_batched_tokens=128, num_blocks=40)
    requests = template_requests(templates, picks)
    for request in requests:
        scheduler.add_request(request)
    first = step(scheduler)
    # One request per template computes the prefix; the others wait for it.
    assert [s.request.request_id for s in first.scheduled] == ["r0", "r1"]
    second = step(scheduler)
    admitted = {s.request.request_id: s.start for s in second.scheduled if s.request.request_id not in ("r0", "r1")}
    assert admitted == {"r2": 16, "r3": 16, "r4": 16, "r5": 16}
    outputs = [first, second, *run_to_completion(scheduler)]
    assert computed_prompt_tokens(outputs) == 2 * 18 + 4 * 2

    arrival = make_scheduler(max_num_seqs=8, max_num_batched_tokens=128, num_blocks=40, prefix_aware_admission=False)
    again = template_requests(templates, picks)
    for request in again:
        arrival.add_request(request)
    outputs = run_to_completion(arrival)
    # Arrival order admits all six at once, so every one computes its whole prompt.
    assert computed_prompt_tokens(outputs) == 6 * 18
    assert [r.num_output_tokens for r in again] == [r.num_output_tokens for r in requests]


def test_a_new_prefix_starts_only_while_started_groups_keep_room():
    """Three templates of 4 blocks, three rows each, 20 blocks: starting a third
    template would leave its own and the first two groups' rows no block to hit with."""
    templates = [list(range(100 * (t + 1), 100 * (t + 1) + 16)) for t in range(3)]
    scheduler = make_scheduler(max_num_seqs=9, max_num_batched_tokens=128, num_blocks=20)
    requests = template_requests(templates, [0, 1, 2] * 3)
    for request in requests:
        scheduler.add_request(request)
    assert [s.request.request_id for s in step(scheduler).scheduled] == ["r0", "r1"]
    outputs = run_to_completion(scheduler)
    # Each template's blocks are computed once: every later row hits them.
    assert [r.num_cached_tokens for r in requests] == [0, 0, 0, 16, 16, 16, 16, 16, 16]
    assert all(r.num_preemptions == 0 for r in requests) and outputs


def test_the_longest_cached_prefix_is_admitted_first():
    templates = [list(range(100, 108)), list(range(200, 216))]
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, num_blocks=40)
    warm = template_requests(templates, [0, 1])
    for request in warm:
        scheduler.add_request(request)
    run_to_completion(scheduler)
    cold = Request("r2", list(range(900, 918)), 2, arrival_index=2)
    short = Request("r3", templates[0] + [1, 2], 2, arrival_index=3)
    long = Request("r4", templates[1] + [1, 2], 2, arrival_index=4)
    for request in (cold, short, long):
        scheduler.add_request(request)
    order = []
    while scheduler.has_unfinished_requests():
        output = step(scheduler)
        order += [s.request for s in output.scheduled if s.request not in order]
    assert order == [long, short, cold]


def test_priority_comes_before_any_prefix_hit():
    templates = [list(range(100, 116))]
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, num_blocks=40)
    (warm,) = template_requests(templates, [0])
    scheduler.add_request(warm)
    run_to_completion(scheduler)
    hit = Request("r1", templates[0] + [1, 2], 2, priority=1, arrival_index=1)
    urgent = Request("r2", list(range(900, 918)), 2, priority=0, arrival_index=2)
    scheduler.add_request(hit)
    scheduler.add_request(urgent)
    assert [s.request for s in step(scheduler).scheduled] == [urgent]


def test_an_overdue_request_goes_before_better_cached_ones():
    """A stream of requests hitting a cached prefix cannot keep a cold one waiting
    past the age bound."""
    template = list(range(100, 116))
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, num_blocks=40)
    assert scheduler.admission is not None
    scheduler.admission.max_wait_steps = 4
    cold = Request("r0", list(range(900, 918)), 1, arrival_index=0)
    scheduler.add_request(Request("r1000", template + [7], 1, arrival_index=0))
    scheduler.add_request(cold)
    admitted_at = None
    for index in range(1, 30):
        scheduler.add_request(Request(f"r{index}", template + [index], 1, arrival_index=index))
        output = step(scheduler)
        if any(s.request is cold for s in output.scheduled):
            admitted_at = index
            break
    assert admitted_at is not None and 4 <= admitted_at <= 6


def test_wanted_prefixes_stay_resident():
    """Blocks a waiting request would hit are evicted after blocks nobody wants,
    whatever order they were freed in."""
    kv_cache = KVCacheManager(num_blocks=8, block_size=4)
    admission = PrefixAwareAdmission(kv_cache)
    wanted = Request("a", list(range(10, 18)) + [1], 1)
    unwanted = Request("b", list(range(20, 28)) + [1], 1)
    for request in (wanted, unwanted):
        assert kv_cache.allocate_slots(request, 9)
        request.num_computed_tokens = 9
        kv_cache.free(request)  # "a" freed first: LRU would evict it first
    later = Request("c", list(range(10, 18)) + [2], 1)
    assert list(admission.order([later], [])) == [later]
    filler = Request("d", list(range(30, 50)), 1)
    assert kv_cache.allocate_slots(filler, 20)  # 5 of the 6 free blocks
    blocks, num_hit = kv_cache.get_computed_blocks(later)
    assert num_hit == 8 and len(blocks) == 2


def check_admissions(scheduler, before: dict[str, tuple[int, bool]], output) -> None:
    """Requests admitted in a step against those left waiting: a lower priority value
    first, and an overdue request overtaken only by a lower priority value or an
    earlier overdue one. ``before``: (priority, overdue) of each waiting request."""
    admitted = [s.request for s in output.scheduled if s.request.request_id in before]
    for request in admitted:
        priority, overdue = before[request.request_id]
        for left in scheduler.waiting:
            if left.request_id not in before or left in output.preempted:
                continue
            left_priority, left_overdue = before[left.request_id]
            if left_overdue:
                assert priority < left_priority or (
                    overdue and priority == left_priority and request.arrival_index <= left.arrival_index), \
                    (request.request_id, left.request_id)


@pytest.mark.parametrize("seed", range(30))
def test_random_template_workloads_keep_the_invariants(seed):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    num_blocks = rng.randint(12, 40)
    max_model_len = num_blocks * block_size
    scheduler = make_scheduler(
        block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
        max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(4, 32))
    admission = scheduler.admission
    assert admission is not None
    admission.max_wait_steps = rng.randint(1, 8)
    templates = [[rng.randint(0, 50) for _ in range(rng.randint(1, 3 * block_size))] for _ in range(3)]
    requests = []
    for index in range(rng.randint(4, 20)):
        tail = [rng.randint(0, 50) for _ in range(rng.randint(0, 5))]
        prompt = (rng.choice(templates) + tail)[: max_model_len - 1] or [1]
        requests.append(Request(f"r{index}", prompt, rng.randint(1, 4), priority=rng.randint(0, 2),
                                arrival_index=index))
    pending = list(requests)
    tracker = KVTracker(block_size)
    aborted = set()
    for _ in range(3000):
        while pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests():
            break
        if scheduler.has_unfinished_requests() and rng.random() < 0.03:
            victim = rng.choice([r for r in requests if scheduler.get_request(r.request_id)])
            scheduler.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim.request_id)
        before = {r.request_id: (r.priority, admission.rounds_waited(r) + 1 > admission.max_wait_steps)
                  for r in scheduler.waiting}
        output = scheduler.schedule()
        assert set(scheduler.waiting).isdisjoint(scheduler.running)
        assert all(r.status is RequestStatus.RUNNING for r in scheduler.running)
        check_admissions(scheduler, before, output)
        tracker.run(output)
        finished = []
        for item in output.scheduled:
            request = item.request
            if item.is_last_chunk:
                request.append_output_token(rng.randint(0, 50))
                if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
                    finished.append(request.request_id)
        scheduler.finish_requests(finished, RequestStatus.FINISHED_LENGTH)
    else:
        pytest.fail("scheduler did not finish the workload")
    for request in requests:
        expected = RequestStatus.FINISHED_ABORTED if request.request_id in aborted else RequestStatus.FINISHED_LENGTH
        assert request.status is expected
    assert scheduler.kv_cache.num_free_blocks == num_blocks
    assert not admission._queued_at  # every finished request forgotten
