"""The parts that let an image's rows attend to each other both ways (Gemma 3): the
scheduler never ends a chunk inside such an image, the step's key limits cover each
image's run of rows, the torch path's masks reach them, and the Triton backend hands
such a step to the torch path."""

from __future__ import annotations

import numpy as np
import torch

from shardline.engine.attention.backends import TorchBackend, TritonBackend
from shardline.engine.attention.context import AttentionOptions, StepBatch
from shardline.engine.attention.torch_plans import TorchAttentionPlan, visible_keys
from shardline.engine.core.request import Request
from shardline.engine.core.scheduler import Scheduler, SchedulerConfig, whole_images
from shardline.engine.multimodal.encoder_cache import image_key_limits
from shardline.engine.multimodal.inputs import ImageInput


def _request(request_id: str, num_tokens: int, *spans: tuple[int, int], bidirectional: bool = True) -> Request:
    images = tuple(ImageInput(f"{request_id}-{first}", tuple(range(first, end)), {}, bidirectional=bidirectional)
                   for first, end in spans)
    return Request(request_id, list(range(100, 100 + num_tokens)), 4, images=images)


def test_a_chunk_ends_before_an_image_it_would_split():
    request = _request("a", 30, (5, 21))
    assert whole_images(request, 0, 20) == 5  # would end inside [5, 21): ends at 5
    assert whole_images(request, 5, 20) == 20  # holds the image whole
    assert whole_images(request, 5, 10) == 0  # starts at the image, no room for it
    assert whole_images(request, 21, 3) == 3  # past it
    assert whole_images(_request("b", 30, (5, 21), bidirectional=False), 0, 20) == 20  # causal images split


def test_the_scheduler_runs_each_image_in_one_step():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=20, max_model_len=64, block_size=4,
                                          num_blocks=32, enable_prefix_caching=False))
    request = _request("a", 40, (5, 21), (24, 40))
    scheduler.add_request(request)
    chunks = []
    while request.num_computed_tokens < request.num_prompt_tokens:
        output = scheduler.schedule()
        chunks += [(item.start, item.start + item.num_new_tokens) for item in output.scheduled]
    assert chunks == [(0, 5), (5, 24), (24, 40)]


def test_key_limits_reach_the_end_of_each_run_of_rows():
    # One image whose rows come in two runs (crops between markers), chunk [2, 12).
    request = _request("a", 20, (0, 0))
    image = ImageInput("x", (3, 4, 5, 8, 9), {}, bidirectional=True)
    request.images = (image,)

    class Item:
        def __init__(self) -> None:
            self.request, self.start, self.num_new_tokens = request, 2, 10

    positions = np.arange(2, 12)
    limits = image_key_limits([Item()], [0], positions)  # type: ignore[list-item]
    assert limits is not None
    assert limits.tolist() == [2, 5, 5, 5, 6, 7, 9, 9, 10, 11]


def test_the_plan_mask_lets_image_rows_see_later_keys():
    # One fresh request of 6 tokens whose rows 1..3 are one image.
    step = StepBatch(slot_mapping=torch.arange(6), query_start_loc=torch.tensor([0, 6]), seq_lens=torch.tensor([6]),
                     block_tables=torch.tensor([[0, 1]], dtype=torch.int32), kv_caches=[], max_query_len=6,
                     max_seq_len=6, key_limits=torch.tensor([0, 3, 3, 3, 4, 5]))
    plan = TorchAttentionPlan.build(step, torch.tensor([0]), block_size=4)
    assert not plan.fresh  # not causal alone
    mask = plan.mask(AttentionOptions(scale=1.0))[0, 0, :, :6]
    positions = torch.arange(6)
    expected = visible_keys(positions[:, None], positions[None, :], AttentionOptions(scale=1.0))
    expected[1:4, 1:4] = True
    assert torch.equal(mask, expected)
    window = plan.mask(AttentionOptions(scale=1.0, sliding_window=2))[0, 0, :, :6]
    assert window[1].tolist() == [True, True, True, True, False, False]  # later image keys pass the window
    assert window[3].tolist() == [False, False, True, True, False, False]


def test_the_triton_backend_hands_steps_with_key_limits_to_the_torch_path():
    step = StepBatch(slot_mapping=torch.arange(3), query_start_loc=torch.tensor([0, 3]), seq_lens=torch.tensor([3]),
                     block_tables=torch.tensor([[0]], dtype=torch.int32),
                     kv_caches=[(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8))], max_query_len=3, max_seq_len=3,
                     key_limits=torch.tensor([0, 2, 2]))
    assert isinstance(TritonBackend().build_context(step).backend, TorchBackend)
