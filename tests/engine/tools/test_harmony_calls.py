"""gpt-oss tool calls beside the harmony reasoning split: a message addressed to a
function is a call, not reasoning, so its arguments are neither in the reasoning
text nor among the reasoning tokens, and the budget never cuts them."""

from __future__ import annotations

import pytest

from shardline.engine.model.tiny import build_tokenizer
from shardline.engine.sampling.harmony import HarmonyTracker, make_harmony_parser
from shardline.engine.sampling.reasoning import TokenRole
from shardline.engine.tools import ToolChoice, make_tool_parser, read_tool_calls

HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("harmony-tokenizer"), extra_special_tokens=HARMONY)


def roles(tracker: HarmonyTracker, token_ids: list[int]) -> list[TokenRole]:
    return [tracker.feed(token_id) for token_id in token_ids]


def test_a_call_body_is_neither_reasoning_nor_answer(tokenizer):
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = encode("<|start|>user<|message|>Weather?<|end|><|start|>assistant")
    thinking, arguments = encode("Look it up."), encode('{"city": "Oslo"}')
    generated = (encode("<|channel|>analysis<|message|>") + thinking + encode("<|end|><|start|>assistant")
                 + encode("<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>") + arguments
                 + encode("<|call|>"))
    tracker = make_harmony_parser(tokenizer).tracker(prompt, max_reasoning_tokens=None)
    seen = roles(tracker, generated)
    assert seen.count(TokenRole.REASONING) == len(thinking) == tracker.num_reasoning_tokens
    assert TokenRole.ANSWER not in seen

    [call] = read_tool_calls(make_tool_parser("openai", tokenizer), ToolChoice("auto", ("lookup",)), generated,
                             "").calls
    assert (call.name, call.arguments) == ("lookup", '{"city": "Oslo"}')


def test_the_budget_does_not_cut_a_call(tokenizer):
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    parser = make_harmony_parser(tokenizer)
    tracker = parser.tracker(encode("<|start|>assistant"), max_reasoning_tokens=0)
    roles(tracker, encode("<|channel|>commentary to=functions.lookup<|message|>"))
    assert tracker.forced_token_id is None and tracker.num_reasoning_tokens == 0
    tracker = parser.tracker(encode("<|start|>assistant"), max_reasoning_tokens=0)
    roles(tracker, encode("<|channel|>analysis<|message|>"))
    assert tracker.forced_token_id == parser.end_id  # a reasoning body is cut at once
