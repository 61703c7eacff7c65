"""Reasoning parsers: a reasoning model's thinking is split from its answer, the
structured-output constraint applies to the answer only, and a budget caps the
thinking."""

from __future__ import annotations

import math

import pytest

from shardline import LLM, SamplingParams
from shardline.engine.config import ConfigError
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.params import StructuredOutputsParams
from shardline.engine.sampling.reasoning import (
    Phase,
    ReasoningParserError,
    ReasoningTracker,
    TokenRole,
    make_reasoning_parser,
)

THINK_TAGS = ["<think>", "</think>"]
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory) -> str:
    """A tiny random model whose tokenizer has <think> and </think> special tokens."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-thinking"), "qwen3", extra_special_tokens=THINK_TAGS))


@pytest.fixture(scope="module")
def r1_llm(thinking_model_dir):
    llm = LLM(thinking_model_dir, dtype="float64", max_num_seqs=8, reasoning_parser="deepseek_r1")
    yield llm
    llm.close()


def think_ids(llm: LLM) -> tuple[int, int]:
    tokenizer = llm.get_tokenizer()
    return tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>")


def prompt_ids(llm: LLM, text: str, suffix: list[int]) -> dict:
    return {"prompt_token_ids": llm.get_tokenizer()(text).input_ids + suffix}


def test_budget_ends_reasoning_and_the_split_follows_the_tokens(r1_llm):
    start, end = think_ids(r1_llm)
    prompt = prompt_ids(r1_llm, "Question: two plus two?", [start])
    [free] = r1_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    [output] = r1_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                                                      max_reasoning_tokens=6), use_tqdm=False)
    tokens = output.outputs[0].token_ids
    decode = r1_llm.get_tokenizer().decode
    # Reasoning runs as it would without a budget, then the end tag is forced.
    assert tokens[:6] == free.outputs[0].token_ids and tokens[6] == end
    assert end not in free.outputs[0].token_ids
    assert output.outputs[0].reasoning == decode(tokens[:6], skip_special_tokens=True)
    assert output.outputs[0].text == decode(tokens[7:], skip_special_tokens=True)
    assert len(tokens) == 14


def test_constraint_applies_only_after_reasoning(r1_llm):
    start, end = think_ids(r1_llm)
    prompts = [prompt_ids(r1_llm, text, [start]) for text in ("Summarize the text", "Translate to French", "café")]
    free = r1_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    constrained = r1_llm.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=40, max_reasoning_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=CHOICES)), use_tqdm=False)
    for before, after in zip(free, constrained):
        completion = after.outputs[0]
        assert completion.token_ids[:8] == before.outputs[0].token_ids  # thinking was free
        assert completion.token_ids[8] == end
        assert completion.text in CHOICES and completion.finish_reason == "stop"
        assert completion.reasoning == before.outputs[0].reasoning
    # The thinking is not itself one of the choices: the grammar did not apply to it.
    assert any(not any(c.startswith(o.outputs[0].reasoning) for c in CHOICES) for o in constrained)


def test_r1_reasons_from_the_start_without_tags_in_the_prompt(r1_llm):
    [output] = r1_llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                               use_tqdm=False)
    completion = output.outputs[0]
    assert completion.text == "" and completion.reasoning == r1_llm.get_tokenizer().decode(
        completion.token_ids, skip_special_tokens=True)


def test_cut_during_reasoning_has_no_answer(r1_llm):
    start, _ = think_ids(r1_llm)
    [output] = r1_llm.generate(prompt_ids(r1_llm, "Hello", [start]), SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, structured_outputs=StructuredOutputsParams(json={
            "type": "object"})), use_tqdm=False)
    assert output.outputs[0].finish_reason == "length" and output.outputs[0].text == ""
    assert output.outputs[0].reasoning


def test_qwen3_answers_directly_after_an_empty_think_block(thinking_model_dir):
    llm = LLM(thinking_model_dir, dtype="float64", max_num_seqs=4, reasoning_parser="qwen3")
    try:
        start, end = think_ids(llm)
        no_thinking = prompt_ids(llm, "Summarize the text", [start, end])
        [output] = llm.generate(no_thinking, SamplingParams(
            temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(choice=CHOICES)),
            use_tqdm=False)
        assert output.outputs[0].text in CHOICES and output.outputs[0].reasoning is None
        # Without any tag the model chooses: its first token may open a think block or
        # begin the answer; after an answer token, only the grammar is allowed.
        # (logprobs are taken before logit_bias, which here makes it answer.)
        [scored] = llm.generate(prompt_ids(llm, "Summarize the text", []), SamplingParams(
            temperature=0.0, max_tokens=30, logprobs=-1, logit_bias={start: -100.0},
            structured_outputs=StructuredOutputsParams(choice=CHOICES)), use_tqdm=False)
        completion = scored.outputs[0]
        first, second = completion.logprobs[0], completion.logprobs[1]
        allowed_first = {t for t, p in first.items() if math.isfinite(p.logprob)}
        assert start in allowed_first and len(allowed_first) > 1
        assert completion.token_ids[0] != start and completion.text in CHOICES and completion.reasoning is None
        assert not math.isfinite(second[start].logprob)
    finally:
        llm.close()


def test_reasoning_is_none_without_a_parser(tiny_llm):
    [output] = tiny_llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)
    assert output.outputs[0].reasoning is None


def test_bad_reasoning_options_are_errors(tiny_llama_dir, tiny_llm):
    with pytest.raises(ConfigError, match="reasoning_parser.*'mystery'"):
        LLM(tiny_llama_dir, reasoning_parser="mystery")
    with pytest.raises(ReasoningParserError, match="<think>"):
        make_reasoning_parser("qwen3", tiny_llm.get_tokenizer())
    with pytest.raises(ValueError, match="request 'r'.*max_reasoning_tokens=5.*reasoning_parser"):
        tiny_llm.llm_engine.add_request("r", "x", SamplingParams(max_reasoning_tokens=5))
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_reasoning_tokens"):
        SamplingParams(max_reasoning_tokens=-1)


def test_tracker_phases(r1_llm):
    start, end = think_ids(r1_llm)
    r1 = make_reasoning_parser("deepseek_r1", r1_llm.get_tokenizer())
    qwen3 = make_reasoning_parser("qwen3", r1_llm.get_tokenizer())
    assert r1.initial_phase([5, 6]) is Phase.REASONING and qwen3.initial_phase([5, 6]) is Phase.UNDECIDED
    assert qwen3.initial_phase([start, 7, end, 8]) is Phase.ANSWER
    tracker = ReasoningTracker(qwen3, [5], max_reasoning_tokens=2)
    roles = [tracker.feed(t) for t in (start, 9, 10)]
    assert roles == [TokenRole.TAG, TokenRole.REASONING, TokenRole.REASONING] and tracker.must_end_reasoning
    assert tracker.feed(end) is TokenRole.TAG and tracker.phase is Phase.ANSWER and not tracker.must_end_reasoning
    assert tracker.feed(start) is TokenRole.ANSWER  # no way back into reasoning
    r1_tracker = ReasoningTracker(r1, [5], max_reasoning_tokens=None)
    assert r1_tracker.feed(start) is TokenRole.TAG and r1_tracker.feed(start) is TokenRole.REASONING
