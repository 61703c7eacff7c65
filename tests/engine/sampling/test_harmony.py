"""gpt-oss's harmony format as a reasoning parser: analysis bodies are reasoning, the
final channel's body is the answer, headers are neither; the structured-output
constraint applies to the answer only, and a spent budget forces the final channel."""

from __future__ import annotations

import pytest

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.params import StructuredOutputsParams
from shardline.engine.sampling.harmony import HarmonyTracker
from shardline.engine.sampling.reasoning import Phase, ReasoningParserError, TokenRole, make_reasoning_parser

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>"]
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def harmony_llm(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("tiny-harmony"), "llama", extra_special_tokens=HARMONY_TOKENS)
    llm = LLM(str(model), dtype="float64", max_num_seqs=8, reasoning_parser="openai_gptoss")
    yield llm
    llm.close()


def ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_tracker_splits_channels_and_reads_the_prompts_last_message(harmony_llm):
    parser = make_reasoning_parser("openai_gptoss", harmony_llm.get_tokenizer())
    prompt = ids(harmony_llm, "<|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert parser.initial_phase(prompt)[0] is Phase.HEADER
    assert parser.initial_phase(prompt + ids(harmony_llm, "<|channel|>analysis<|message|>"))[0] is Phase.REASONING
    assert parser.initial_phase(prompt + ids(harmony_llm, "<|channel|>final<|message|>"))[0] is Phase.ANSWER
    assert parser.initial_phase(ids(harmony_llm, "plain text"))[0] is Phase.HEADER

    tracker = HarmonyTracker(parser, prompt, max_reasoning_tokens=None)
    generated = ids(harmony_llm, "<|channel|>analysis<|message|>") + [7, 8] + ids(
        harmony_llm, "<|end|><|start|>assistant<|channel|>final<|message|>") + [9, 10]
    roles = [tracker.feed(token_id) for token_id in generated]
    tag, reasoning, answer = TokenRole.TAG, TokenRole.REASONING, TokenRole.ANSWER
    header = len(ids(harmony_llm, "<|channel|>analysis<|message|>"))
    final = len(ids(harmony_llm, "<|end|><|start|>assistant<|channel|>final<|message|>"))
    assert roles == [tag] * header + [reasoning] * 2 + [tag] * final + [answer] * 2
    assert tracker.phase is Phase.ANSWER and tracker.reasoned and tracker.num_reasoning_tokens == 2
    # A commentary body is reasoning too; only the final channel answers.
    tracker = HarmonyTracker(parser, prompt, max_reasoning_tokens=None)
    for token_id in ids(harmony_llm, "<|channel|>commentary<|constrain|>json<|message|>"):
        tracker.feed(token_id)
    assert tracker.phase is Phase.REASONING and tracker.feed(7) is TokenRole.REASONING


def test_budget_forces_the_final_channel_and_the_constraint_applies_after_it(harmony_llm):
    tokenizer = harmony_llm.get_tokenizer()
    prompt = {"prompt_token_ids": ids(harmony_llm, "<|start|>user<|message|>Rate it.<|end|>"
                                                   "<|start|>assistant<|channel|>analysis<|message|>")}
    [free] = harmony_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                  use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=60, max_reasoning_tokens=6,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    [output] = harmony_llm.generate(prompt, params, use_tqdm=False)
    completion = output.outputs[0]
    final_header = ids(harmony_llm, "<|end|><|start|>assistant<|channel|>final<|message|>")
    tokens = completion.token_ids
    # Reasoning runs as it would without a budget, then the final channel is forced open.
    assert tokens[:6] == free.outputs[0].token_ids and not set(tokens[:6]) & set(final_header)
    assert tokens[6:6 + len(final_header)] == final_header
    assert completion.reasoning == tokenizer.decode(tokens[:6], skip_special_tokens=True)
    assert completion.text in CHOICES and completion.finish_reason == "stop"


def test_a_prompt_that_opens_the_final_channel_answers_at_once(harmony_llm):
    prompt = {"prompt_token_ids": ids(harmony_llm, "<|start|>user<|message|>Rate it.<|end|>"
                                                   "<|start|>assistant<|channel|>final<|message|>")}
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    for output in harmony_llm.generate([prompt] * 3, params, use_tqdm=False):
        assert output.outputs[0].text in CHOICES and output.outputs[0].reasoning is None


def test_a_tokenizer_without_harmony_tokens_is_refused(tiny_llm):
    with pytest.raises(ReasoningParserError, match=r"needs the harmony tokens .* the tokenizer has no <\|start\|>"):
        make_reasoning_parser("openai_gptoss", tiny_llm.get_tokenizer())
