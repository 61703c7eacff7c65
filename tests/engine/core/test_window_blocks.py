"""WindowedKVCacheManager: windowed groups drop the blocks no later query reads, through
the real scheduler with prefix caching, forks and preemption; block counts per group;
the byte budget split between groups."""

from __future__ import annotations

import random

import pytest

from shardline.engine.core.kv_cache import KVCacheManager, blocks_needed
from shardline.engine.core.request import Request, RequestStatus
from shardline.engine.core.scheduler import Scheduler, SchedulerConfig
from shardline.engine.core.window_blocks import (
    CHUNKED,
    FULL,
    NULL_BLOCK_ID,
    SLIDING,
    LayerGroup,
    WindowedKVCacheManager,
    WindowedLayout,
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


class CacheContents:
    """What each slot of each pool holds, as a runner would write it: the request's
    tokens up to that position (the KV at a position depends on all of them)."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int, int], tuple[int, ...]] = {}  # (group, block, offset) -> prefix

    def write(self, group: int, block_ids: list[int], request: Request, start: int, end: int) -> None:
        tokens = request.all_token_ids
        for position in range(start, end):
            block_id = block_ids[position // BLOCK_SIZE]
            assert block_id != NULL_BLOCK_ID or group == 0, "a write into a dropped block"
            self.slots[(group, block_id, position % BLOCK_SIZE)] = tuple(tokens[: position + 1])

    def check_read(self, group: int, block_ids: list[int], request: Request, position: int) -> None:
        block_id = block_ids[position // BLOCK_SIZE]
        assert group == 0 or block_id != NULL_BLOCK_ID, (request.request_id, group, position)
        held = self.slots.get((group, block_id, position % BLOCK_SIZE))
        assert held == tuple(request.all_token_ids[: position + 1]), (request.request_id, group, position)

    def copy(self, group: int, src: int, dst: int) -> None:
        for offset in range(BLOCK_SIZE):
            if (group, src, offset) in self.slots:
                self.slots[(group, dst, offset)] = self.slots[(group, src, offset)]


def check_tables(manager: WindowedKVCacheManager, scheduler: Scheduler, starts: dict[str, int]) -> None:
    """Each block is held by as many tables as its ref count says; windowed tables keep
    no block before what the first query of the request's last step (``starts``) reads."""
    holders: list[dict[int, int]] = [{} for _ in manager.groups]
    for request in scheduler.running:
        for group, (spec, block_ids) in enumerate(zip(manager.groups, manager.live_group_block_ids(
                request.request_id), strict=True)):
            assert len(block_ids) == len(manager.live_block_ids(request.request_id))
            first = spec.first_read(starts[request.request_id]) // BLOCK_SIZE
            assert all(block_id == NULL_BLOCK_ID for block_id in block_ids[:first])
            for block_id in block_ids:
                if block_id != NULL_BLOCK_ID:
                    holders[group][block_id] = holders[group].get(block_id, 0) + 1
    for group, pool in enumerate(manager.group_pools):
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders[group].get(block.block_id, 0), (group, block)


@pytest.mark.parametrize("seed", range(8))
def test_every_read_key_is_held_and_written_through_scheduler(seed: int) -> None:
    """Seeded workloads (shared prefixes, prefix hits, chunked prompts, forks, a cache
    small enough to preempt): every key a step's queries read is in the right block of
    each group, holding what that position computed."""
    rng = random.Random(seed)
    groups = layer_groups([(SLIDING, rng.choice([3, 4, 9, 16])), (CHUNKED, rng.choice([4, 8, 12]))])
    layout = WindowedLayout(groups, (rng.randint(24, 40), rng.randint(24, 40)), (0, 1, 2))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=rng.choice([8, 16, 24]),
                                          max_model_len=96, block_size=BLOCK_SIZE, num_blocks=48,
                                          enable_prefix_caching=True, windowed=layout))
    manager = scheduler.windowed_cache
    assert manager is not None and scheduler.kv_cache is manager
    prefixes = [[rng.randrange(5, 50) for _ in range(rng.randint(10, 30))] for _ in range(3)]
    for index in range(14):
        tokens = rng.choice(prefixes) + [rng.randrange(5, 50) for _ in range(rng.randint(1, 30))]
        scheduler.add_request(Request(f"r{index}", tokens, rng.randint(1, 12)))
    contents = CacheContents()
    forks = 0
    starts: dict[str, int] = {}  # each request's start at its last step: where its tables last dropped
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        for item in output.scheduled:
            request, start, end = item.request, item.start, item.start + item.num_new_tokens
            tables = [item.block_ids, *item.group_block_ids]
            for group in range(1 + len(groups)):
                contents.write(group, tables[group], request, start, end)
            for group, spec in enumerate((LayerGroup(FULL, None, ()), *groups)):
                for query in range(start, end):
                    for key in keys_read(spec, query):
                        contents.check_read(group, tables[group], request, key)
        starts.update((item.request.request_id, item.start) for item in output.scheduled)
        for item in output.scheduled:
            request = item.request
            if item.is_last_chunk and request.status is RequestStatus.RUNNING:
                request.append_output_token(rng.randrange(5, 50))
                if request.num_output_tokens >= request.max_tokens:
                    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_LENGTH)
                elif request.num_output_tokens == 1 and forks < 4 and rng.random() < 0.5:
                    forks += 1
                    child = Request(f"{request.request_id}-f", request.prompt_token_ids, request.max_tokens)
                    child.output_token_ids.extend(request.output_token_ids)
                    child.num_output_tokens = child_tokens = len(request.output_token_ids)
                    child.num_tokens = request.num_tokens
                    assert child_tokens == 1
                    starts[child.request_id] = item.start  # the parent's table, dropped at its start
                    copy = scheduler.fork_request(request, child)
                    if copy is not None:
                        contents.copy(0, *copy)
                    for group, pairs in enumerate(scheduler.take_group_copies(), 1):
                        for src, dst in pairs:
                            contents.copy(group, src, dst)
        check_tables(manager, scheduler, starts)
    assert forks
    assert all(pool.num_free_blocks == len(pool.blocks) - 1 for pool in manager.group_pools)
    assert manager.stats.num_hit_tokens > 0  # the shared prefixes were hit


def test_sliding_group_holds_the_window_and_the_full_group_everything() -> None:
    groups = layer_groups([(SLIDING, 8)])
    manager = WindowedKVCacheManager(100, BLOCK_SIZE, False, groups, [100])
    request = Request("r", list(range(64)), max_tokens=1)
    for _ in range(16):  # a prompt of 64 tokens computed 4 at a time
        assert manager.allocate_slots(request, 4)
        request.num_computed_tokens += 4
    assert manager.allocate_slots(request, 1)  # the first decode step, at position 64
    (sliding,) = manager.live_group_block_ids("r")
    full = manager.live_block_ids("r")
    # Position 64 reads keys 57..64: blocks 14, 15 and 16 (positions 56..67).
    assert [index for index, block_id in enumerate(sliding) if block_id != NULL_BLOCK_ID] == [14, 15, 16]
    assert len(sliding) == len(full) == 17
    assert (manager.num_free_group_blocks(0), manager.num_free_blocks) == (99 - 3, 100 - 17)
    manager.free(request)
    assert (manager.num_free_group_blocks(0), manager.num_free_blocks) == (99, 100)


def test_a_pool_short_of_blocks_refuses_and_allocates_nothing() -> None:
    manager = WindowedKVCacheManager(50, BLOCK_SIZE, False, layer_groups([(SLIDING, 4)]), [6])
    first, second = Request("a", list(range(16)), max_tokens=1), Request("b", list(range(16)), max_tokens=1)
    assert manager.allocate_slots(first, 16)
    assert not manager.allocate_slots(second, 8)  # the windowed pool has one block left
    assert (manager.num_free_group_blocks(0), manager.num_free_blocks) == (1, 50 - 4)
    assert manager.live_block_ids("a") and "b" not in manager._group_tables
    manager.free(first)
    assert manager.allocate_slots(second, 8)


def test_a_prefix_hit_needs_every_group_to_cache_the_blocks_its_next_query_reads() -> None:
    manager = WindowedKVCacheManager(60, BLOCK_SIZE, True, layer_groups([(SLIDING, 8)]), [30])
    prompt = list(range(100, 140))  # 10 blocks
    first = Request("a", prompt, max_tokens=1)
    assert manager.allocate_slots(first, 40)
    first.num_computed_tokens = 40
    manager.free(first)
    second = Request("b", [*prompt, 7], max_tokens=1)
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 40
    assert manager.allocate_slots(second, 1, hit_blocks)
    # Position 40 reads keys 33..40: the hit brings blocks 8 and 9, the rest stay dropped.
    (sliding,) = manager.live_group_block_ids("b")
    assert [index for index, block_id in enumerate(sliding) if block_id != NULL_BLOCK_ID] == [8, 9, 10]
    manager.free(second)
    manager.group_pools[0].reset()  # the windowed group forgets its blocks; the full one keeps them
    assert manager.get_computed_blocks(Request("c", [*prompt, 7], max_tokens=1)) == ([], 0)


def count_resident(scheduler: Scheduler, model_len: int, num_requests: int) -> int:
    """Requests of ``model_len`` prompt tokens resident at once, each computing its prompt
    and its first sampled token and none finishing: the most running after each step
    until a preemption or every request is running."""
    for index in range(num_requests):
        scheduler.add_request(Request(f"r{index}", [3 + index] * model_len, max_tokens=10_000))
    most = 0
    while scheduler.waiting and not scheduler.num_preemptions:
        output = scheduler.schedule()
        if output.is_empty:
            break  # the cache holds no more
        for item in output.scheduled:
            if item.is_last_chunk and not item.request.num_output_tokens:
                item.request.append_output_token(5)
        most = max(most, len(scheduler.running))
    return most


def test_split_budget_holds_more_requests_than_one_table_for_all_layers() -> None:
    groups = layer_groups([(FULL, None)] + [(SLIDING, 64)] * 5)
    model_len, chunk, layer_block = 1024, 64, 100
    budget = 6 * layer_block * blocks_needed(model_len + 1, BLOCK_SIZE) * 10
    one_table = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=chunk, max_model_len=model_len,
                                          block_size=BLOCK_SIZE, num_blocks=budget // (6 * layer_block),
                                          enable_prefix_caching=False))
    before = count_resident(one_table, model_len, 200)
    assert before == 10
    num_blocks = split_budget(groups, [layer_block, 5 * layer_block], budget, BLOCK_SIZE, model_len, chunk, 256)
    assert num_blocks[0] * layer_block + num_blocks[1] * 5 * layer_block <= budget + 6 * layer_block
    layout = WindowedLayout(groups[1:], (num_blocks[1],), (0, 1, 1, 1, 1, 1))
    per_group = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=chunk, max_model_len=model_len,
                                          block_size=BLOCK_SIZE, num_blocks=num_blocks[0],
                                          enable_prefix_caching=False, windowed=layout))
    # Per request 257 full blocks and 18 of each sliding layer, against 6 * 257.
    assert count_resident(per_group, model_len, 200) >= 4 * before
    assert isinstance(one_table.kv_cache, KVCacheManager) and one_table.windowed_cache is None
