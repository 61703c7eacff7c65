"""The runner's packed batch (engine/model/input_batch.py) against one built from
scratch per step, and the engine's per-sequence state kept across steps (sample rows
reused whole in steady steps) when a request id is taken again by another request."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from shardline import SamplingParams
from shardline.engine.core.request import Request, RequestStatus
from shardline.engine.core.scheduler import Scheduler, SchedulerConfig
from shardline.engine.model.input_batch import InputRows
from shardline.engine.model.runner import LogitsPlan


def reference_pack(scheduled, block_size: int, pending_rows: dict[str, int] | None) -> dict:
    """The step's layout, built per token from each request's own tokens and table; a
    position past a request's known tokens reads its pending token (input 0)."""
    token_ids, positions, slots, query_start_loc, seq_lens, last_chunks = [], [], [], [0], [], []
    pending_positions, pending_sources = [], []
    for index, item in enumerate(scheduled):
        tokens = item.request.all_token_ids
        for position in range(item.start, item.start + item.num_new_tokens):
            if position < len(tokens):
                token_ids.append(tokens[position])
            else:
                pending_positions.append(len(token_ids))
                pending_sources.append(pending_rows[item.request.request_id])
                token_ids.append(0)
            positions.append(position)
            slots.append(item.block_ids[position // block_size] * block_size + position % block_size)
        query_start_loc.append(len(token_ids))
        seq_lens.append(item.start + item.num_new_tokens)
        if item.is_last_chunk:
            last_chunks.append(index)
    return dict(token_ids=token_ids, positions=positions, slot_mapping=slots, query_start_loc=query_start_loc,
                seq_lens=seq_lens, last_chunks=last_chunks, request_ids=[i.request.request_id for i in scheduled],
                pending_positions=pending_positions, pending_rows=pending_sources)


def check_step(rows: InputRows, output, block_size: int, pending_rows: dict[str, int] | None) -> None:
    packed = rows.pack(output.scheduled, pending_rows)
    expected = reference_pack(output.scheduled, block_size, pending_rows)
    assert packed.token_ids == expected["token_ids"]
    for name in ("positions", "slot_mapping", "query_start_loc", "seq_lens"):
        assert getattr(packed, name).tolist() == expected[name], name
    for name in ("last_chunks", "request_ids", "pending_positions", "pending_rows"):
        assert list(getattr(packed, name)) == expected[name], name
    assert packed.max_query_len == max(item.num_new_tokens for item in output.scheduled)
    for index, item in enumerate(output.scheduled):
        assert packed.block_tables[index, : len(item.block_ids)].tolist() == item.block_ids
    wants_prompt_logprobs = any(item.request.params.prompt_logprobs is not None for item in output.scheduled)
    assert packed.any_prompt_logprobs == wants_prompt_logprobs
    plan = LogitsPlan.of(output.scheduled, packed)
    reference = LogitsPlan()
    for index, item in enumerate(output.scheduled):
        reference.add(item, expected["query_start_loc"][index])
    assert (plan.keep, plan.sample_rows, plan.prompt_rows) == (
        reference.keep, reference.sample_rows, reference.prompt_rows)


@pytest.mark.parametrize("deferring", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(4))
def test_pack_equals_a_layout_built_from_scratch(seed, deferring):
    """Chunked prefill, decoding, preemption (a small cache), finished requests whose
    ids come back with other prompts, rows reclaimed and grown; with ``deferring``,
    most steps leave their sampled tokens pending through the next step's packing, as
    the engine's async scheduling does."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(24, 40)
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=rng.randint(2, 9), max_num_batched_tokens=rng.randint(4, 32),
        max_model_len=min(64, num_blocks * block_size), block_size=block_size, num_blocks=num_blocks))
    rows = InputRows(2, 1, block_size)  # small, so rows are reclaimed and the arrays grow
    ids = [f"r{i}" for i in range(12)]
    active: set[str] = set()
    in_flight: list[tuple[Request, int]] = []  # a deferred step's sampled tokens, in row order

    def process(sampled: list[tuple[Request, int]], deferred: bool) -> None:
        finished = []
        for request, token in sampled:
            request.num_pending_tokens -= deferred
            if request.is_finished:
                continue  # finished before this token: it is discarded
            request.append_output_token(token)
            if request.num_output_tokens >= request.max_tokens or rng.random() < 0.05:
                finished.append(request.request_id)
        scheduler.finish_requests(finished, RequestStatus.FINISHED_LENGTH)
        active.difference_update(finished)

    for _ in range(400):
        for request_id in ids:
            if request_id not in active and rng.random() < 0.1:
                prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]  # max_model_len >= 24
                params = SamplingParams(prompt_logprobs=1 if rng.random() < 0.2 else None)
                scheduler.add_request(Request(request_id, prompt, rng.randint(1, 12), params=params))
                active.add(request_id)
        output = scheduler.schedule()
        pending_rows = {request.request_id: row for row, (request, _) in enumerate(in_flight)} or None
        if not output.is_empty:
            check_step(rows, output, block_size, pending_rows)
        process(in_flight, deferred=True)
        sampled = [(item.request, rng.randrange(1000)) for item in output.scheduled if item.is_last_chunk]
        in_flight = []
        if deferring and rng.random() < 0.8:
            for request, _ in sampled:
                request.num_pending_tokens += 1
            in_flight = sampled
        else:
            process(sampled, deferred=False)


def test_a_request_id_taken_again_gets_its_own_row():
    rows = InputRows(4, 2, 4)
    first = Request("x", [1, 2, 3], 4, params=SamplingParams())
    step = [SimpleNamespace(request=first, start=0, num_new_tokens=3, block_ids=[7], num_tokens=3,
                            is_last_chunk=True)]
    assert not rows.pack(step).any_prompt_logprobs
    second = Request("x", [4, 5, 6], 4, params=SamplingParams(prompt_logprobs=2))
    step = [SimpleNamespace(request=second, start=0, num_new_tokens=3, block_ids=[9], num_tokens=3,
                            is_last_chunk=True)]
    packed = rows.pack(step)
    assert packed.any_prompt_logprobs and packed.token_ids == [4, 5, 6]
    assert packed.slot_mapping.tolist() == [36, 37, 38] and packed.block_tables.tolist() == [[9]]
    assert isinstance(packed.positions, np.ndarray)


def test_a_finished_id_taken_again_samples_with_its_own_row(tiny_llm):
    """A one-sequence steady step sampled 'a' from logits row 0; a new request 'a' with
    a one-token prompt samples from row 0 too, and must not be sampled as the old one."""
    engine = tiny_llm.llm_engine
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = []
    for prompt, params in (([5, 6, 7], plain), ([9], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))):
        engine.add_request("a", {"prompt_token_ids": prompt}, params)
        for _ in range(20):
            outputs += engine.step()
            if not engine.has_unfinished_requests():
                break
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 6]
    fresh = tiny_llm.generate([{"prompt_token_ids": [9]}], SamplingParams(temperature=0.0, max_tokens=6,
                                                                          ignore_eos=True), use_tqdm=False)
    assert outputs[1].outputs[0].token_ids == fresh[0].outputs[0].token_ids
