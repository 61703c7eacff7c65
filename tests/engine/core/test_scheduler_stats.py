"""Scheduler.stats: the counts a health line shows, read from the scheduler's own state."""

from __future__ import annotations

from .test_scheduler import _fill_cache_then_grow, make_requests, make_scheduler, run_to_completion, step


def test_stats_count_running_waiting_cache_use_and_preemptions():
    scheduler, (first, second) = _fill_cache_then_grow(enable_prefix_caching=False)
    before = scheduler.stats(num_steps=2)
    assert (before.num_running, before.num_waiting, before.num_preemptions, before.num_steps) == (2, 0, 0, 2)
    assert before.kv_cache_usage == 1.0  # two 7-token prompts hold all four blocks
    assert before.prefix_cache_hit_rate is None  # prefix caching is off
    assert step(scheduler).preempted == [second]
    after = scheduler.stats()
    assert (after.num_running, after.num_waiting, after.num_preemptions) == (1, 1, 1)
    assert after.kv_cache_usage == 0.75
    run_to_completion(scheduler)
    done = scheduler.stats()
    assert (done.num_running, done.num_waiting, done.num_preemptions, done.kv_cache_usage) == (0, 0, 1, 0.0)


def test_stats_hit_rate_counts_prefix_hits_at_admission():
    scheduler = make_scheduler(num_blocks=32, max_model_len=64)
    shared = list(range(90000, 90016))  # four full blocks of 4 tokens
    first = make_requests(1, prompt_len=20, max_tokens=1, prefix=shared)[0]
    scheduler.add_request(first)
    run_to_completion(scheduler)
    assert scheduler.stats().prefix_cache_hit_rate == 0.0
    second = make_requests(1, prompt_len=20, max_tokens=1, prefix=shared, start_index=1)[0]
    scheduler.add_request(second)
    run_to_completion(scheduler)
    hit_rate = scheduler.stats().prefix_cache_hit_rate
    assert hit_rate is not None and hit_rate == second.num_cached_tokens / (20 + 20) and second.num_cached_tokens > 0
