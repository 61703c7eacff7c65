"""Scheduler: token budget, seq limit, chunked prefill, priorities, preemption, prefix hits."""

from __future__ import annotations

import random

import pytest

from shardline.engine.core.partial_blocks import BlockCopy
from shardline.engine.core.request import Request, RequestStatus
from shardline.engine.core.scheduler import (
    PromptTooLongError,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)


def make_scheduler(**overrides) -> Scheduler:
    options = dict(
        max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4, num_blocks=32,
        enable_prefix_caching=True,
    )
    options.update(overrides)
    return Scheduler(SchedulerConfig(**options))


_next_token = [1000]


def make_requests(
    n: int,
    prompt_len: int,
    max_tokens: int = 4,
    priorities: list[int] | None = None,
    prefix: list[int] = (),
    start_index: int = 0,
) -> list[Request]:
    """``n`` requests with distinct prompts (after an optional shared ``prefix``)."""
    requests = []
    for i in range(n):
        tokens = list(prefix) + list(range(_next_token[0], _next_token[0] + prompt_len - len(prefix)))
        _next_token[0] += prompt_len
        priority = priorities[i] if priorities else 0
        index = start_index + i
        requests.append(Request(f"r{index}", tokens, max_tokens, priority=priority, arrival_index=index))
    return requests


def fake_token(request: Request) -> int:
    return (int(request.request_id[1:]) * 31 + request.num_tokens) % 997


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, 'run', append a token to last chunks, finish at max_tokens."""
    output = scheduler.schedule()
    config = scheduler.config
    assert output.num_scheduled_tokens == sum(s.num_new_tokens for s in output.scheduled)
    assert output.num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(scheduler.running) <= config.max_num_seqs
    finished = []
    for item in output.scheduled:
        request = item.request
        assert item.num_new_tokens > 0
        assert len(item.block_ids) * config.block_size >= item.start + item.num_new_tokens
        assert request.num_computed_tokens == item.start + item.num_new_tokens
        if item.is_last_chunk:
            request.append_output_token(fake_token(request))
            if request.num_output_tokens >= request.max_tokens or request.num_tokens >= config.max_model_len:
                finished.append(request.request_id)
    scheduler.finish_requests(finished, RequestStatus.FINISHED_LENGTH)
    return output


def run_to_completion(scheduler: Scheduler, max_steps: int = 2000) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs.append(step(scheduler))
        assert len(outputs) < max_steps, "scheduler made no progress"
    return outputs


def test_config_rejects_non_positive_limits():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer, got 0"):
        make_scheduler(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_num_seqs .* got -1"):
        make_scheduler(max_num_seqs=-1)


def test_prompt_too_long_names_request_length_and_limit():
    scheduler = make_scheduler(max_model_len=16, num_blocks=8)
    with pytest.raises(PromptTooLongError, match=r"'r0'.*17 tokens.*max_model_len=16"):
        scheduler.add_request(Request("r0", list(range(17)), 1))
    small_cache = make_scheduler(max_model_len=16, num_blocks=4)
    # 16 tokens plus one generated token need 5 blocks of 4; the cache has 4.
    with pytest.raises(PromptTooLongError, match=r"'r1'.*16 tokens.*5 KV blocks.*4 blocks.*limit 15"):
        small_cache.add_request(Request("r1", list(range(16)), 1))
    small_cache.add_request(Request("r2", list(range(15)), 1))
    assert not scheduler.has_unfinished_requests()


def test_duplicate_id_and_empty_prompt_are_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(Request("r0", [1, 2], 1))
    with pytest.raises(ValueError, match="'r0' is already"):
        scheduler.add_request(Request("r0", [3], 1))
    with pytest.raises(ValueError, match="'r1' has an empty prompt"):
        scheduler.add_request(Request("r1", [], 1))


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for request in make_requests(5, prompt_len=3):
        scheduler.add_request(request)
    output = step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["r0", "r1"]
    assert scheduler.get_num_unfinished_requests() == 5 and len(scheduler.waiting) == 3
    outputs = run_to_completion(scheduler)
    assert all(len(o.scheduled) <= 2 for o in outputs)


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    (long_request,) = make_requests(1, prompt_len=20, max_tokens=2)
    scheduler.add_request(long_request)
    chunks = [(s.start, s.num_new_tokens, s.is_last_chunk) for s in step(scheduler).scheduled]
    chunks += [(s.start, s.num_new_tokens, s.is_last_chunk) for s in step(scheduler).scheduled]
    chunks += [(s.start, s.num_new_tokens, s.is_last_chunk) for s in step(scheduler).scheduled]
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert long_request.num_output_tokens == 1
    assert [(s.start, s.num_new_tokens) for s in step(scheduler).scheduled] == [(20, 1)]
    assert not scheduler.has_unfinished_requests()


def test_running_requests_come_first_and_admission_uses_the_leftover_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    first, second = make_requests(2, prompt_len=12)
    scheduler.add_request(first)
    scheduler.add_request(second)
    assert [(s.request.request_id, s.num_new_tokens) for s in step(scheduler).scheduled] == [("r0", 8)]
    output = step(scheduler)
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in output.scheduled] == [
        ("r0", 8, 4), ("r1", 0, 4)
    ]


def test_admission_follows_priority_then_arrival():
    scheduler = make_scheduler(max_num_seqs=1)
    for request in make_requests(5, prompt_len=3, max_tokens=1, priorities=[2, 0, 1, 0, -1]):
        scheduler.add_request(request)
    order = [o.scheduled[0].request.request_id for o in run_to_completion(scheduler)]
    assert order == ["r4", "r1", "r3", "r2", "r0"]


def test_blocked_waiting_request_stops_admission():
    # r0 holds most of the cache; r1 (first in line) does not fit, so the small r2
    # behind it must wait too: strict priority order, no skipping ahead.
    scheduler = make_scheduler(num_blocks=8, max_model_len=32, max_num_batched_tokens=64)
    scheduler.add_request(make_requests(1, prompt_len=20, max_tokens=3)[0])
    step(scheduler)
    scheduler.add_request(make_requests(1, prompt_len=16, start_index=1)[0])
    scheduler.add_request(make_requests(1, prompt_len=2, start_index=2)[0])
    assert [s.request.request_id for s in step(scheduler).scheduled] == ["r0"]


def _fill_cache_then_grow(enable_prefix_caching: bool, priorities=(0, 0)) -> tuple[Scheduler, list[Request]]:
    """Two 7-token prompts fill a 4-block cache; the first one's 9th token needs a block."""
    scheduler = make_scheduler(num_blocks=4, max_model_len=16, enable_prefix_caching=enable_prefix_caching)
    requests = make_requests(2, prompt_len=7, max_tokens=4, priorities=list(priorities))
    for request in requests:
        scheduler.add_request(request)
    step(scheduler)  # prefill both: 2 blocks each
    step(scheduler)  # decode token 8: still 2 blocks each
    return scheduler, requests


def test_out_of_blocks_preempts_the_latest_arrival_and_recomputes_it():
    scheduler, (first, second) = _fill_cache_then_grow(enable_prefix_caching=False)
    output = step(scheduler)
    assert output.preempted == [second]
    assert [s.request for s in output.scheduled] == [first]
    assert second.status is RequestStatus.PREEMPTED and second.num_preemptions == 1
    assert second.num_computed_tokens == 0 and scheduler.kv_cache.get_block_ids("r1") == []
    assert scheduler.waiting == [second]
    tokens_before = second.all_token_ids
    outputs = run_to_completion(scheduler)
    resumed = next(s for o in outputs for s in o.scheduled if s.request is second)
    assert (resumed.start, resumed.num_new_tokens) == (0, len(tokens_before))  # recompute
    assert first.num_output_tokens == second.num_output_tokens == 4
    assert second.all_token_ids[: len(tokens_before)] == tokens_before


def test_preempted_request_resumes_from_its_own_cached_blocks():
    scheduler, (_, second) = _fill_cache_then_grow(enable_prefix_caching=True)
    assert step(scheduler).preempted == [second]
    outputs = run_to_completion(scheduler)
    resumed = next(s for o in outputs for s in o.scheduled if s.request is second)
    assert resumed.start in (4, 8) and second.num_cached_tokens == 0  # first admission only


def test_out_of_blocks_preempts_the_lowest_priority_even_if_earlier():
    scheduler, (first, second) = _fill_cache_then_grow(enable_prefix_caching=False, priorities=(1, 0))
    output = step(scheduler)
    # first (priority 1) needs a block, and is itself the lowest priority: it stops.
    assert output.preempted == [first]
    assert [s.request for s in output.scheduled] == [second]
    assert first.status is RequestStatus.PREEMPTED


def test_waiting_request_with_higher_priority_preempts_running_ones():
    scheduler = make_scheduler(num_blocks=6, max_model_len=24, max_num_batched_tokens=64)
    low = make_requests(2, prompt_len=11, max_tokens=8, priorities=[5, 5])
    for request in low:
        scheduler.add_request(request)
    step(scheduler)  # 3 blocks each: the cache is full
    (urgent,) = make_requests(1, prompt_len=6, priorities=[0], start_index=2)
    scheduler.add_request(urgent)
    output = step(scheduler)
    assert output.preempted == [low[1]]
    assert [s.request for s in output.scheduled] == [low[0], urgent]
    run_to_completion(scheduler)
    assert [r.num_output_tokens for r in (*low, urgent)] == [8, 8, 4]


def test_priority_preemption_takes_as_many_victims_as_needed_and_refunds_their_budget():
    # block_size 1: one block per token. Two low-priority requests hold the whole cache.
    scheduler = make_scheduler(block_size=1, num_blocks=12, max_model_len=12, max_num_batched_tokens=12)
    low = make_requests(2, prompt_len=5, max_tokens=3, priorities=[5, 5])
    for request in low:
        scheduler.add_request(request)
    step(scheduler)
    (urgent,) = make_requests(1, prompt_len=11, max_tokens=1, priorities=[0], start_index=2)
    scheduler.add_request(urgent)
    output = step(scheduler)
    # Both decodes were scheduled, then undone: their tokens go back to the budget, so
    # the urgent prompt is computed whole (11 tokens), not chunked to 12 - 2.
    assert output.preempted == [low[1], low[0]]
    assert [(s.request, s.start, s.num_new_tokens) for s in output.scheduled] == [(urgent, 0, 11)]
    assert output.num_scheduled_tokens == 11
    run_to_completion(scheduler)
    assert [r.num_output_tokens for r in (*low, urgent)] == [3, 3, 1]


def test_no_admission_in_a_step_that_preempted():
    scheduler, (first, second) = _fill_cache_then_grow(enable_prefix_caching=False)
    (urgent,) = make_requests(1, prompt_len=1, priorities=[-1], start_index=2)
    scheduler.add_request(urgent)  # one block is free after the preemption, but not for it
    output = step(scheduler)
    assert output.preempted == [second] and [s.request for s in output.scheduled] == [first]
    assert [s.request for s in step(scheduler).scheduled] == [first, urgent]


def test_a_request_preempted_in_a_step_is_not_readmitted_in_it():
    scheduler = make_scheduler(block_size=1, num_blocks=12, max_model_len=12, enable_prefix_caching=False)
    low = make_requests(2, prompt_len=5, max_tokens=3, priorities=[5, 5])
    for request in low:
        scheduler.add_request(request)
    step(scheduler)  # 6 tokens each; the two decodes below fill the cache
    (urgent,) = make_requests(1, prompt_len=1, priorities=[0], start_index=2)
    scheduler.add_request(urgent)
    # With 7 tokens, low[1]'s recompute would be chunked to 5 tokens, which the 5 blocks
    # left after urgent's admission could hold.
    scheduler.config.max_num_batched_tokens = 7
    output = step(scheduler)
    assert output.preempted == [low[1]]
    assert [s.request for s in output.scheduled] == [low[0], urgent]


def test_waiting_request_of_equal_priority_does_not_preempt():
    scheduler = make_scheduler(num_blocks=6, max_model_len=24, max_num_batched_tokens=64)
    for request in make_requests(2, prompt_len=11, max_tokens=8):
        scheduler.add_request(request)
    step(scheduler)
    scheduler.add_request(make_requests(1, prompt_len=6, start_index=2)[0])
    output = step(scheduler)
    assert output.preempted == [] and [s.request.request_id for s in output.scheduled] == ["r0", "r1"]


def test_second_request_with_same_prefix_hits_the_cache():
    scheduler = make_scheduler()
    (first,) = make_requests(1, prompt_len=10, max_tokens=1)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    assert first.num_cached_tokens == 0
    (second,) = make_requests(1, prompt_len=11, prefix=first.prompt_token_ids, start_index=1)
    (same,) = make_requests(1, prompt_len=8, prefix=first.prompt_token_ids[:8], start_index=2)
    scheduler.add_request(second)
    scheduler.add_request(same)
    output = step(scheduler)
    # Two full blocks and two tokens of the third (copied); the whole prompt but its last token.
    assert [(s.start, s.num_new_tokens) for s in output.scheduled] == [(10, 1), (7, 1)]
    assert second.num_cached_tokens == 10 and same.num_cached_tokens == 7  # capped at num_tokens - 1
    copies = [s.block_copy for s in output.scheduled]
    assert [(c.num_tokens, c.dst_block) for c in copies if c] == [(2, output.scheduled[0].block_ids[2]),
                                                                   (3, output.scheduled[1].block_ids[1])]
    first_blocks = scheduler.kv_cache.get_block_ids("r1")
    assert scheduler.kv_cache.get_block_ids("r2")[0] == first_blocks[0]
    assert scheduler.kv_cache.pool.blocks[first_blocks[0]].ref_cnt == 2


def test_finish_requests_aborts_running_and_waiting_and_frees_blocks():
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_requests(2, prompt_len=9)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 32 - 3
    finished = scheduler.finish_requests(["r0", "nope"], RequestStatus.FINISHED_ABORTED)
    assert finished == [running] and running.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache.num_free_blocks == 32 and scheduler.running == []
    assert scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED) == [waiting]
    assert not scheduler.has_unfinished_requests() and scheduler.get_request("r1") is None
    assert scheduler.schedule().is_empty
    with pytest.raises(ValueError, match="RUNNING"):
        scheduler.finish_requests("r0", RequestStatus.RUNNING)


class KVTracker:
    """Simulates the runner writing KV into slots, to check what each step reads.

    The KV of position p stands for (cache_salt, tokens[: p + 1]); a step computing
    [start, end) must find the right KV at every earlier position of its block table.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple] = {}

    def slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def copy(self, copies: list[BlockCopy]) -> None:
        """The runner's copy_block_prefixes: every source read before any destination is written."""
        size = self.block_size
        moves = [(copy.dst_block * size + offset, self.slots.get(copy.src_block * size + offset))
                 for copy in copies for offset in range(copy.num_tokens)]
        for slot, value in moves:
            assert value is not None, "a partial hit copies a slot no step wrote"
            self.slots[slot] = value

    def run(self, output: SchedulerOutput) -> None:
        self.copy([item.block_copy for item in output.scheduled if item.block_copy is not None])
        written = set()
        for item in output.scheduled:
            tokens = tuple(item.request.all_token_ids)
            salt = item.request.cache_salt
            for position in range(item.start):
                assert self.slots.get(self.slot(item.block_ids, position)) == (salt, tokens[: position + 1])
            for position in range(item.start, item.start + item.num_new_tokens):
                slot = self.slot(item.block_ids, position)
                assert slot not in written, "two requests write the same slot in one step"
                written.add(slot)
                self.slots[slot] = (salt, tokens[: position + 1])


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_finish_every_request_with_correct_kv(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(4, 24)
    max_model_len = rng.randint(2, num_blocks * block_size)
    scheduler = make_scheduler(
        block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
        max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 24),
        enable_prefix_caching=rng.random() < 0.8,
    )
    max_prompt = min(max_model_len, num_blocks * block_size - 1)
    shared_prefix = [rng.randint(0, 3) for _ in range(max_prompt)]
    requests = []
    for index in range(rng.randint(1, 14)):
        prompt_len = rng.randint(1, max_prompt)
        num_shared = rng.randint(0, prompt_len)
        prompt = shared_prefix[:num_shared] + [rng.randint(0, 3) for _ in range(prompt_len - num_shared)]
        request = Request(
            f"r{index}", prompt, rng.randint(1, 6), priority=rng.randint(0, 2), arrival_index=index,
            cache_salt=rng.choice([None, "lora"]),
        )
        requests.append(request)
    pending = list(requests)
    tracker = KVTracker(block_size)
    aborted = set()
    for _ in range(3000):
        while pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests():
            break
        if scheduler.has_unfinished_requests() and rng.random() < 0.02:
            victim = rng.choice([r for r in requests if scheduler.get_request(r.request_id)])
            scheduler.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim.request_id)
        output = scheduler.schedule()
        scheduled = {s.request.request_id for s in output.scheduled}
        assert not scheduled & {r.request_id for r in output.preempted}
        assert output.num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        assert len(output.scheduled) <= scheduler.config.max_num_seqs
        if scheduler.running and not output.preempted:
            assert not output.is_empty, "running requests but nothing scheduled"
        tracker.run(output)
        finished = []
        for item in output.scheduled:
            request = item.request
            if item.is_last_chunk:
                request.append_output_token(rng.randint(0, 3))
                if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
                    finished.append(request.request_id)
        scheduler.finish_requests(finished, RequestStatus.FINISHED_LENGTH)
    else:
        pytest.fail("scheduler did not finish the workload")
    for request in requests:
        if request.request_id in aborted:
            assert request.status is RequestStatus.FINISHED_ABORTED
            continue
        expected = min(request.max_tokens, max_model_len - request.num_prompt_tokens)
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.num_output_tokens == max(expected, 1)
    assert scheduler.kv_cache.num_free_blocks == num_blocks
    assert all(block.ref_cnt == 0 for block in scheduler.kv_cache.pool.blocks)


def test_a_pending_token_is_scheduled_and_never_past_max_tokens():
    """Async scheduling: a running request's pending token (sampled, not yet appended)
    counts as a token to compute, its block is not hashed before the token is known,
    and a request whose pending token is its last is not scheduled again."""
    scheduler = make_scheduler(block_size=4)
    [request] = make_requests(1, prompt_len=7, max_tokens=3)
    scheduler.add_request(request)
    scheduler.schedule()  # the prompt, positions 0..6
    request.num_pending_tokens = 1  # its first token, sampled on the device
    [item] = scheduler.schedule().scheduled
    assert (item.start, item.num_new_tokens, item.is_last_chunk) == (7, 1, True)
    # Positions 0..7 are computed, but token 7 is unknown: only block 0 is cached.
    assert len(scheduler.kv_cache.pool.cached_blocks) == 1
    request.append_output_token(11)  # the first token arrives; the second is pending
    [item] = scheduler.schedule().scheduled  # position 8 reads the pending token
    assert (item.start, item.num_tokens) == (8, 9)
    assert len(scheduler.kv_cache.pool.cached_blocks) == 2
    request.append_output_token(12)  # token 8 known; token 9 pending is its third, its last
    assert scheduler.schedule().is_empty


def test_aborting_a_request_with_a_pending_token_caches_only_known_blocks():
    scheduler = make_scheduler(block_size=4)
    [request] = make_requests(1, prompt_len=7, max_tokens=3)
    scheduler.add_request(request)
    scheduler.schedule()
    request.num_pending_tokens = 1
    scheduler.schedule()  # computes position 7, whose token the host does not know yet
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    assert len(scheduler.kv_cache.pool.cached_blocks) == 1
    assert scheduler.kv_cache.num_free_blocks == scheduler.config.num_blocks
