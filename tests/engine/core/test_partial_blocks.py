"""Token-granular prefix hits (engine/core/partial_blocks.py): the index, the KV cache's
lookups and the scheduler's copies, including what must never be a hit."""

from __future__ import annotations

import random

import torch

from shardline.engine.core.kv_cache import KVCacheManager
from shardline.engine.core.partial_blocks import BlockCopy, PartialBlocks, parent_key
from shardline.engine.core.request import Request, RequestStatus
from shardline.engine.core.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, StepPlan
from shardline.engine.multimodal.inputs import ImageInput

from .test_scheduler import KVTracker


def _request(request_id: str, prompt: list[int], max_tokens: int = 4, **kwargs) -> Request:
    return Request(request_id, prompt, max_tokens, **kwargs)


def _compute(kv_cache: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Admit ``request`` with its prefix hit and mark ``num_tokens`` in all as computed."""
    hit_blocks, num_hit = kv_cache.get_computed_blocks(request)
    assert kv_cache.allocate_slots(request, num_tokens - num_hit, hit_blocks)
    request.num_computed_tokens = num_tokens


def test_longest_run_among_blocks_of_the_same_parent():
    index = PartialBlocks()
    root = parent_key(None, None)
    index.record(3, root, [1, 2, 3, 4])
    index.record(5, root, [1, 2, 9])
    index.record(7, parent_key(b"x" * 16, None), [1, 2, 3, 4])
    assert index.longest(root, [1, 2, 3, 8]) == (3, 3)
    assert index.longest(root, [1, 2, 9, 9]) == (5, 3)
    assert index.longest(root, [2, 2]) == (-1, 0)  # no block starts with token 2
    assert index.longest(parent_key(None, "salt"), [1, 2, 3]) == (-1, 0)  # another salt, another chain
    index.record(3, root, [1, 2, 3, 4, 5])  # the block's owner computed one more token
    assert index.longest(root, [1, 2, 3, 4, 5, 6]) == (3, 5) and len(index) == 3
    index.drop(3)
    assert index.longest(root, [1, 2, 3, 8]) == (5, 2)
    index.clear()
    assert index.longest(root, [1, 2, 9]) == (-1, 0) and len(index) == 0


def test_a_running_requests_partial_block_is_found_and_dropped_when_reallocated():
    kv_cache = KVCacheManager(num_blocks=8, block_size=4)
    first = _request("a", [5, 6, 7, 8, 9, 10, 11])
    _compute(kv_cache, first, 7)
    assert kv_cache.allocate_slots(first, 1)  # the next step: tokens below 7 are written
    second = _request("b", [5, 6, 7, 8, 9, 10, 12, 13])
    hit_blocks, num_hit = kv_cache.get_computed_blocks(second)
    assert num_hit == 4
    block_id, num_tokens = kv_cache.partial_hit(second, len(hit_blocks))
    assert (block_id, num_tokens) == (kv_cache.get_block_ids("a")[1], 2)
    kv_cache.free(first)
    assert kv_cache.partial_hit(second, 1) == (block_id, 2)  # free, its slots intact
    # Allocating every free block reuses it for other tokens: no longer a hit.
    third = _request("c", list(range(100, 131)))
    assert kv_cache.allocate_slots(third, 31)
    assert kv_cache.partial_hit(second, 1) == (-1, 0)


def test_partial_hits_stop_before_the_last_token_skip_images_and_end_with_reset():
    kv_cache = KVCacheManager(num_blocks=8, block_size=4)
    first = _request("a", [5, 6, 7, 8, 9, 10, 11, 12, 13])
    _compute(kv_cache, first, 9)
    kv_cache.free(first)
    # The last token is always computed, so the model yields logits.
    assert kv_cache.partial_hit(_request("b", [5, 6, 7, 8, 9, 10, 11]), 1)[1] == 2
    assert kv_cache.partial_hit(_request("c", [5, 6, 7, 8, 9]), 1) == (-1, 0)
    # A request with a different salt shares nothing.
    assert kv_cache.partial_hit(_request("d", [5, 6, 7, 9], cache_salt="lora-1"), 0) == (-1, 0)
    assert kv_cache.reset_prefix_cache() > 0
    assert kv_cache.partial_hit(_request("e", [5, 6, 7, 9]), 0) == (-1, 0)


def _image(image_hash: str, start: int, end: int) -> ImageInput:
    return ImageInput(image_hash, tuple(range(start, end)), {"pixel_values": torch.zeros(1, 3, 2, 2)})


def test_positions_an_image_fills_match_only_the_same_images_same_rows():
    kv_cache = KVCacheManager(num_blocks=8, block_size=4)
    first = _request("a", [5, 6, 7, 8, 9, 9, 9], images=(_image("h1", 4, 6),))
    _compute(kv_cache, first, 7)
    block = kv_cache.get_block_ids("a")[1]
    kv_cache.free(first)
    # The same image at the same positions: its two rows are a hit (and no encoder row is needed for them).
    src, num_copied = kv_cache.partial_hit(_request("b", [5, 6, 7, 8, 9, 9, 1, 1], images=(_image("h1", 4, 6),)), 1)
    assert (src, num_copied) == (block, 2)
    # The same tokens without the image, another image, or the image one position later: no hit.
    assert kv_cache.partial_hit(_request("c", [5, 6, 7, 8, 9, 9, 1, 1]), 1) == (-1, 0)
    assert kv_cache.partial_hit(_request("d", [5, 6, 7, 8, 9, 9, 1, 1], images=(_image("h2", 4, 6),)), 1) == (-1, 0)
    assert kv_cache.partial_hit(_request("e", [5, 6, 7, 8, 3, 9, 9, 1], images=(_image("h1", 5, 7),)), 1) == (-1, 0)
    # Text before an image in a block matches a text-only block up to the image.
    plain = _request("f", [5, 6, 7, 8, 3, 3, 3])
    _compute(kv_cache, plain, 7)
    kv_cache.free(plain)
    with_image = _request("g", [5, 6, 7, 8, 3, 3, 1, 1], images=(_image("h2", 6, 8),))
    assert kv_cache.partial_hit(with_image, 1)[1] == 2


def _scheduler(**overrides) -> Scheduler:
    config = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32, block_size=4, num_blocks=16)
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config))  # type: ignore[arg-type]


def _finish_step(scheduler: Scheduler, tracker: KVTracker) -> None:
    output = scheduler.schedule()
    tracker.run(output)
    for item in output.scheduled:
        request = item.request
        if item.is_last_chunk:
            request.append_output_token(1)
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_LENGTH)


def test_scheduler_copies_the_matched_tokens_and_starts_after_them():
    scheduler = _scheduler()
    tracker = KVTracker(4)
    template = [7, 3, 9, 1, 4, 4]
    scheduler.add_request(_request("a", template + [20, 21, 22], max_tokens=1))
    _finish_step(scheduler, tracker)
    row = _request("b", template + [30, 31], max_tokens=1)
    scheduler.add_request(row)
    output = scheduler.schedule()
    (item,) = output.scheduled
    assert (item.start, item.num_new_tokens) == (6, 2) and row.num_cached_tokens == 6
    assert item.block_copy is not None and item.block_copy.num_tokens == 2
    assert item.block_copy.dst_block == item.block_ids[1] != item.block_copy.src_block
    tracker.run(output)  # the copied slots hold the template's KV


def test_recurrent_models_get_no_partial_hits():
    scheduler = _scheduler(num_state_slots=4, num_state_snapshots=2)
    assert scheduler.kv_cache.pool.partial is None
    scheduler = _scheduler(enable_prefix_caching=False)
    assert scheduler.kv_cache.pool.partial is None


def test_unscheduling_an_admission_gives_back_its_copied_tokens():
    """A request taken out of the step that admitted it had its slots neither copied
    nor computed: none of them counts as computed (so none is cached at its free)."""
    request = _request("a", list(range(10)))
    request.num_computed_tokens = 9  # 4 hit, 2 copied, 3 scheduled
    step = StepPlan(token_budget=5)
    step.scheduled.append(ScheduledRequest(request, 6, 3, [0, 1, 2], 10, block_copy=BlockCopy(5, 1, 2)))
    assert step.unschedule(request) is not None
    assert request.num_computed_tokens == 4 and step.token_budget == 8


def _run_template_rows(seed: int) -> int:
    """Rows of a few templates ending anywhere in a block, with priorities, chunking and
    a small cache, run to the end; every slot a step reads (copied or not) must hold its
    token's KV. Returns the number of partial hits copied."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    min_blocks = -(-30 // block_size)  # one request of 26 prompt and 4 output tokens fits
    scheduler = _scheduler(block_size=block_size, num_blocks=rng.randint(min_blocks, min_blocks + 12),
                           max_model_len=30, max_num_batched_tokens=rng.randint(4, 40),
                           max_num_seqs=rng.randint(1, 6), prefix_aware_admission=rng.random() < 0.5)
    tracker = KVTracker(block_size)
    templates = [[rng.randint(0, 5) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    for index in range(rng.randint(4, 16)):
        prompt = rng.choice(templates) + [rng.randint(0, 5) for _ in range(rng.randint(1, 6))]
        scheduler.add_request(_request(f"r{index}", prompt, max_tokens=rng.randint(1, 4),
                                       priority=rng.randint(0, 1)))
    num_copies = 0
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        num_copies += sum(item.block_copy is not None for item in output.scheduled)
        tracker.run(output)
        for item in output.scheduled:
            if item.is_last_chunk:
                item.request.append_output_token(rng.randint(0, 5))
                if item.request.num_output_tokens >= item.request.max_tokens:
                    scheduler.finish_requests(item.request.request_id, RequestStatus.FINISHED_LENGTH)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    return num_copies


def test_random_template_rows_read_only_written_kv():
    num_copies = [_run_template_rows(seed) for seed in range(40)]
    assert sum(count > 0 for count in num_copies) >= 20  # most workloads copy partial hits


def test_block_copy_is_a_value():
    assert BlockCopy(1, 2, 3) == BlockCopy(1, 2, 3)
