"""SamplingTraits (derived once per request) and the Sequences table (one record per
sequence): adding, sample rows, the steady-step cache, forks and removal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardline.engine.core.request import Request
from shardline.engine.model.tiny import build_tokenizer
from shardline.engine.outputs import RequestMetrics
from shardline.engine.params import SamplingParams, SamplingTraits, StructuredOutputsParams
from shardline.engine.sampling.output_processor import OutputProcessor
from shardline.engine.sampling.sequences import RequestState, Sequences


@pytest.mark.parametrize("params, reasoning, expected", [
    (SamplingParams(temperature=0.0), False,
     dict(is_random=False, steady_row=True, argmax_only=True, pipelinable=True, plain_output=True,
          text_at_finish=True, has_logit_processors=False)),
    (SamplingParams(temperature=0.8, seed=3), False,
     dict(is_random=True, argmax_only=False, pipelinable=True, plain_output=True)),
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), False,
     dict(has_penalties=True, has_logit_processors=True, argmax_only=False, pipelinable=False, plain_output=True)),
    (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), False,
     dict(has_penalties=False, has_logit_processors=True, argmax_only=False, pipelinable=True)),
    (SamplingParams(temperature=0.0, min_tokens=2), False,
     dict(steady_row=False, argmax_only=False, pipelinable=False)),
    (SamplingParams(temperature=0.0, bad_words=["x"]), False, dict(steady_row=False, pipelinable=False)),
    (SamplingParams(temperature=0.0, logprobs=1), False,
     dict(wants_logprobs=True, argmax_only=False, pipelinable=False, plain_output=False)),
    (SamplingParams(temperature=0.0, stop=["."]), False, dict(text_at_finish=False, plain_output=True)),
    (SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="a+")), False,
     dict(pipelinable=False, plain_output=False, argmax_only=True)),
    (SamplingParams(temperature=0.0), True,
     dict(reasoning=True, pipelinable=False, plain_output=False, text_at_finish=False)),
])
def test_traits_follow_the_params(params, reasoning, expected):
    traits = SamplingTraits.of(params, reasoning)
    assert {name: getattr(traits, name) for name in expected} == expected


def test_traits_are_frozen():
    traits = SamplingTraits.of(SamplingParams(), reasoning=False)
    with pytest.raises(AttributeError):
        traits.pipelinable = False


@pytest.fixture(scope="module")
def output_processor(tmp_path_factory) -> OutputProcessor:
    return OutputProcessor(build_tokenizer(tmp_path_factory.mktemp("tokenizer")), {1}, max_model_len=64)


def add(table: Sequences, request_id: str, params: SamplingParams, prompt: list[int]) -> list[Request]:
    params.all_stop_token_ids = {1}  # as the engine resolves them: EOS
    state = RequestState(request_id, None, prompt, params, SamplingTraits.of(params, False), None, RequestMetrics(0.0))
    sequences = [Request(request_id if params.n == 1 else f"{request_id}#{i}", prompt, params.max_tokens, params=params)
                 for i in range(params.n)]
    table.add(state, sequences)
    return sequences


def scheduled(*requests: Request) -> list[SimpleNamespace]:
    return [SimpleNamespace(request=request) for request in requests]


def test_records_follow_their_requests_and_steady_rows_are_reused(output_processor):
    forgotten: list[str] = []
    table = Sequences(output_processor.new_sample, lambda parent, children: None, forgotten.append)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    (a,), (b,) = add(table, "a", greedy, [5, 6]), add(table, "b", greedy, [7])
    assert len(table) == 2 and "a" in table and table.state_of("a").request_id == "a"
    rows, deferrable = table.sample_rows(scheduled(a, b), {"a": 0, "b": 1})
    assert [row.sequence for row in rows] == [a, b] and deferrable
    assert all(row.steady and row.logits_row == i for i, row in enumerate(rows))
    again, _ = table.sample_rows(scheduled(a, b), {"a": 0, "b": 1})
    assert again == rows and again is not rows  # the steady step's rows, as a new list
    state = table.remove("a")
    assert state is not None and [s.sequence for s in state.samples] == [a]
    assert forgotten == ["a"] and "a" not in table and table.remove("a") is None
    (a2,) = add(table, "a", SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3), [9])
    rows, _ = table.sample_rows(scheduled(a2, b), {"a": 0, "b": 1})
    assert rows[0].sequence is a2 and not rows[0].steady  # not the removed request's cached row
    assert rows[0].blocked_token_ids == (1,) and rows[0].owner is table.state_of("a")


def test_samples_fork_at_their_first_sampling_with_their_own_generators(output_processor):
    forks: list[tuple[Request, list[Request]]] = []
    table = Sequences(output_processor.new_sample, lambda parent, children: forks.append((parent, children)),
                      lambda sequence_id: None)
    params = SamplingParams(n=3, temperature=0.7, seed=11, max_tokens=4)
    sequences = add(table, "r", params, [4, 5, 6])
    assert table.state_of("r#2").pending_forks == sequences[1:]
    rows, deferrable = table.sample_rows(scheduled(sequences[0]), {"r#0": 0})
    assert forks == [(sequences[0], sequences[1:])] and not deferrable
    assert [row.sequence for row in rows] == sequences and {row.logits_row for row in rows} == {0}
    draws = [row.generator.initial_seed() for row in rows]
    assert draws == [11, 12, 13] and [row.index for row in rows] == [0, 1, 2]
    rows, _ = table.sample_rows(scheduled(*sequences), {"r#0": 0, "r#1": 1, "r#2": 2})
    assert len(forks) == 1 and [row.logits_row for row in rows] == [0, 1, 2]
