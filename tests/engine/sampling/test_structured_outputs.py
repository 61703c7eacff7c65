"""Structured outputs: every constrained output parses and obeys its constraint, even
from a random model, and constraints compose with the rest of the engine."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from shardline import LLM, SamplingParams
from shardline.engine.params import StructuredOutputsParams
from shardline.engine.sampling.structured import (
    StructuredOutputError,
    allow_only,
    allow_token,
    apply_token_bitmask,
    apply_token_bitmask_reference,
    forbidden_picks,
    grammar_key,
    new_bitmask,
)

from ...schemas import LABELS, ORDER, PERSON

PROMPTS = [f"Row {i}: {text}" for i, text in enumerate(
    ["The quick brown fox", "Summarize the text", "café 東京", "def main():", "Question: two plus two?",
     "Translate to French", "emoji 🙂", "A paged key value cache"] * 2)]


def structured(max_tokens: int = 160, seed: int | None = 0, temperature: float = 1.0, **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


@pytest.mark.parametrize("schema", [PERSON, ORDER, LABELS], ids=["bounded-numbers", "nested", "enum-array"])
def test_every_schema_output_parses_and_validates(tiny_llm, schema):
    params = [structured(seed=i, json=schema, disable_any_whitespace=True) for i in range(len(PROMPTS))]
    outputs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), schema)  # strict json.loads: no raw control characters


def test_any_whitespace_outputs_validate_when_complete(tiny_llm):
    outputs = tiny_llm.generate(PROMPTS[:8], [structured(max_tokens=200, seed=i, json=PERSON) for i in range(8)],
                                use_tqdm=False)
    complete = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert complete
    for completion in complete:
        jsonschema.validate(json.loads(completion.text), PERSON)


def test_json_object_and_ebnf_grammar(tiny_llm):
    objects = tiny_llm.generate(PROMPTS[:6], [structured(seed=i, json_object=True, max_tokens=120,
                                                         disable_any_whitespace=True) for i in range(6)],
                                use_tqdm=False)
    for output in objects:
        if output.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(output.outputs[0].text), dict)
    assert any(output.outputs[0].finish_reason == "stop" for output in objects)
    grammar = 'root ::= "(" value ("," value)* ")"\nvalue ::= [0-9] | "x"'
    outputs = tiny_llm.generate(PROMPTS[:6], [structured(seed=i, grammar=grammar, max_tokens=64) for i in range(6)],
                                use_tqdm=False)
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        assert re.fullmatch(r"\((?:[0-9]|x)(?:,(?:[0-9]|x))*\)", output.outputs[0].text)


def test_structural_tag_wraps_a_schema(tiny_llm):
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<answer>"},
        {"type": "json_schema", "json_schema": LABELS},
        {"type": "const_string", "value": "</answer>"}]}}
    outputs = tiny_llm.generate(PROMPTS[:4], [structured(seed=i, structural_tag=json.dumps(tag), max_tokens=200)
                                              for i in range(4)], use_tqdm=False)
    for output in outputs:
        if output.outputs[0].finish_reason == "stop":
            text = output.outputs[0].text
            assert text.startswith("<answer>") and text.endswith("</answer>")
            jsonschema.validate(json.loads(text[len("<answer>"):-len("</answer>")]), LABELS)
    assert any(o.outputs[0].finish_reason == "stop" for o in outputs)


def test_choice_outputs_are_always_one_of_the_choices(tiny_llm):
    choices = ["yes", "no", "maybe so", 'say "hi"', "東京", "a\nb"]
    greedy = tiny_llm.generate(PROMPTS, structured(temperature=0.0, seed=None, choice=choices), use_tqdm=False)
    sampled = tiny_llm.generate(PROMPTS, [structured(seed=i, choice=choices) for i in range(len(PROMPTS))],
                                use_tqdm=False)
    for output in greedy + sampled:
        assert output.outputs[0].text in choices
        assert output.outputs[0].finish_reason == "stop"
    assert len({o.outputs[0].text for o in sampled}) > 1


@pytest.mark.parametrize("pattern",
                         [r"\d{3}-[a-z]{2,5}", r"(red|green|blue)( [0-9]+)?", r"[A-Z][a-z]{0,6}@[a-z]{1,6}\.com"])
def test_regex_outputs_fullmatch(tiny_llm, pattern):
    outputs = tiny_llm.generate(PROMPTS, [structured(seed=i, regex=pattern, max_tokens=64)
                                          for i in range(len(PROMPTS))], use_tqdm=False)
    for output in outputs:
        if output.outputs[0].finish_reason == "stop":
            assert re.fullmatch(pattern, output.outputs[0].text), output.outputs[0].text
    assert sum(o.outputs[0].finish_reason == "stop" for o in outputs) >= len(PROMPTS) // 2


def test_cut_by_max_tokens_finishes_with_length(tiny_llm):
    [output] = tiny_llm.generate(PROMPTS[0], structured(max_tokens=3, json=ORDER), use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)


def test_constrained_and_unconstrained_rows_do_not_affect_each_other(tiny_llm):
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=3)]
    alone = tiny_llm.generate(PROMPTS[:2], free, use_tqdm=False)
    mixed_params = [free[0], structured(json=PERSON, max_tokens=30), free[1], structured(choice=["x", "y"]),
                    structured(regex="[a-z]+", max_tokens=30)]
    mixed = tiny_llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3], PROMPTS[4]], mixed_params,
                              use_tqdm=False)
    for before, after in zip(alone, [mixed[0], mixed[2]]):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
        # Equal up to the rounding of a differently shaped batch's forward pass.
        for position_after, position_before in zip(after.outputs[0].logprobs, before.outputs[0].logprobs):
            assert position_after.keys() == position_before.keys()
            for token_id, entry in position_before.items():
                assert position_after[token_id].logprob == pytest.approx(entry.logprob, rel=1e-9)
                assert position_after[token_id].rank == entry.rank


def test_seeded_constrained_request_is_the_same_alone_and_in_a_batch(tiny_llm):
    params = structured(seed=1234, json=ORDER, disable_any_whitespace=True)
    [alone] = tiny_llm.generate(PROMPTS[5], params, use_tqdm=False)
    neighbours = [structured(seed=i, json=ORDER, max_tokens=60, disable_any_whitespace=True) for i in range(5)]
    batch = tiny_llm.generate(PROMPTS[:8], neighbours + [params]
                              + [SamplingParams(max_tokens=20)] * 2, use_tqdm=False)
    assert batch[5].outputs[0].token_ids == alone.outputs[0].token_ids


def test_grammar_survives_preemption_and_chunked_prefill(tiny_llama_dir, tiny_llm):
    long_prompts = [p * 8 for p in PROMPTS[:6]]
    params = [structured(seed=i, json=ORDER, disable_any_whitespace=True) for i in range(6)]
    roomy = tiny_llm.generate(long_prompts, params, use_tqdm=False)
    tight = LLM(tiny_llama_dir, dtype="float64", max_num_seqs=8, max_num_batched_tokens=64, block_size=16,
                kv_cache_memory_bytes=2 * 2 * 2 * 16 * 16 * 8 * 40)  # 40 blocks: the 6 requests need more
    try:
        squeezed = tight.generate(long_prompts, params, use_tqdm=False)
    finally:
        tight.close()
    assert sum(o.metrics.num_preemptions for o in squeezed) > 0
    for before, after in zip(roomy, squeezed):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
        jsonschema.validate(json.loads(after.outputs[0].text), ORDER)


def test_n_samples_each_follow_the_grammar(tiny_llm):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=160,
                            structured_outputs=StructuredOutputsParams(json=LABELS, disable_any_whitespace=True))
    [output] = tiny_llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert len(output.outputs) == 4
    for completion in output.outputs:
        jsonschema.validate(json.loads(completion.text), LABELS)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_stop_strings_min_tokens_and_logprobs_compose(tiny_llm):
    choices = ["alpha beta", "gamma"]
    [stopped] = tiny_llm.generate(PROMPTS[0], SamplingParams(
        temperature=0.0, max_tokens=20, stop=[" beta"],
        structured_outputs=StructuredOutputsParams(choice=["alpha beta"])), use_tqdm=False)
    assert stopped.outputs[0].text == "alpha" and stopped.outputs[0].stop_reason == " beta"
    # min_tokens cannot keep a finished grammar going: the output still parses.
    [short] = tiny_llm.generate(PROMPTS[1], SamplingParams(
        temperature=0.0, max_tokens=20, min_tokens=15, structured_outputs=StructuredOutputsParams(choice=choices)),
        use_tqdm=False)
    assert short.outputs[0].text in choices and short.outputs[0].finish_reason == "stop"
    [scored] = tiny_llm.generate(PROMPTS[2], SamplingParams(
        temperature=1.0, seed=5, max_tokens=20, logprobs=-1,
        structured_outputs=StructuredOutputsParams(choice=choices)), use_tqdm=False)
    completion = scored.outputs[0]
    assert completion.text in choices
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        finite = {t: p.logprob for t, p in position.items() if p.logprob > float("-inf")}
        assert token_id in finite
        # The logprobs are of the constrained distribution: the allowed tokens sum to one.
        assert sum(torch.tensor(list(finite.values()), dtype=torch.float64).exp()).item() == pytest.approx(1.0)
    assert completion.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(
        completion.token_ids, completion.logprobs)))


def test_ignore_eos_ends_when_the_grammar_is_complete(tiny_llm):
    [output] = tiny_llm.generate(PROMPTS[0], SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, structured_outputs=StructuredOutputsParams(choice=["ok"])),
        use_tqdm=False)
    assert output.outputs[0].text == "ok" and output.outputs[0].finish_reason == "stop"


def test_invalid_constraint_is_an_add_time_error_naming_the_request(tiny_llm):
    bad = [SamplingParams(max_tokens=4), structured(json={"type": "object", "properties": {"a": {"type": "foo"}}})]
    with pytest.raises(ValueError, match=r"request '\d+'.*json.*foo"):
        tiny_llm.generate(PROMPTS[:2], bad, use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    assert not tiny_llm.llm_engine.scheduler.has_unfinished_requests()
    engine = tiny_llm.llm_engine
    for constraint, reason in [({"regex": "[a-z"}, "regex"), ({"grammar": 'root ::= "a" |'}, "grammar"),
                               ({"json": "{not json"}, "not valid JSON"),
                               ({"json": {"type": "string", "pattern": "a+", "maxLength": 3}}, "pattern")]:
        with pytest.raises(StructuredOutputError, match=f"request 'bad'.*{reason}"):
            engine.add_request("bad", "x", structured(**constraint))
        assert not engine.has_unfinished_requests()


def test_constraints_that_leave_no_token_are_an_error_naming_the_request(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    only_digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    contradictory = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=only_digits,
                                   structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    fine = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with pytest.raises(StructuredOutputError, match=r"request '\d+': no token satisfies"):
        tiny_llm.generate(PROMPTS[:3], [fine, contradictory, fine], use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    [after] = tiny_llm.generate(PROMPTS[0], fine, use_tqdm=False)
    assert len(after.outputs[0].token_ids) == 8


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="only use one kind"):
        StructuredOutputsParams(json=PERSON, regex="a")
    with pytest.raises(ValueError, match="must use one kind"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="whitespace_pattern"):
        StructuredOutputsParams(json=PERSON, whitespace_pattern=r"\s*")
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": PERSON})


def test_a_shared_constraint_compiles_once_per_engine(tiny_llm):
    compiler = tiny_llm.llm_engine.structured.compiler
    first = compiler.submit("a", StructuredOutputsParams(json=ORDER))
    assert compiler.submit("b", StructuredOutputsParams(json=json.dumps(ORDER))) is first
    assert compiler.submit("c", StructuredOutputsParams(json=ORDER, disable_any_whitespace=True)) is not first
    assert grammar_key(StructuredOutputsParams(json=ORDER)) == grammar_key(StructuredOutputsParams(json=dict(ORDER)))


def test_a_compiling_grammar_holds_only_its_own_request(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float64", max_num_seqs=4)
    try:
        engine = llm.llm_engine
        schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["k"]}
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            choice=["a", "b"])), use_tqdm=False)  # starts the compile thread
        # Occupy the compile thread so the next grammar stays queued behind it.
        release = threading.Event()
        engine.structured.compiler._executor.submit(release.wait)
        greedy_json = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(
            json=schema, disable_any_whitespace=True))
        engine.add_request("held", PROMPTS[0], greedy_json)
        engine.add_request("free", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        finished = []
        while not finished:
            finished += engine.step()
        assert [o.request_id for o in finished] == ["free"]
        assert engine.scheduler.get_request("held").num_output_tokens == 0
        release.set()
        while engine.has_unfinished_requests():
            finished += engine.step()
        [expected] = llm.generate(PROMPTS[0], greedy_json, use_tqdm=False)  # its grammar compiled, nothing held
        assert finished[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    finally:
        llm.close()


def test_bitmask_application_masks_only_restricted_rows():
    logits = torch.randn(3, 70, dtype=torch.float64)
    bitmask = new_bitmask(3, 70)
    allow_only(bitmask, 1, 63)  # bit 31 of a word: its sign bit
    allow_only(bitmask, 2, 69)
    allow_token(bitmask, 2, 0)
    masked = apply_token_bitmask(logits, bitmask)
    assert torch.equal(masked[0], logits[0])
    assert masked[1].isfinite().nonzero().flatten().tolist() == [63]
    assert masked[2].isfinite().nonzero().flatten().tolist() == [0, 69]
    assert forbidden_picks(bitmask, {1, 2}, [5, 63, 69]) == set()
    assert forbidden_picks(bitmask, {1, 2}, [5, 62, 1]) == {1, 2}
    assert forbidden_picks(bitmask, {0}, [5, 62, 1]) == set()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("vocab_size", [1000, 1024, 31])
def test_bitmask_application_matches_the_reference(dtype, vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(6, vocab_size, generator=generator).to(dtype)
    num_words = (vocab_size + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, num_words), dtype=torch.int32, generator=generator)
    bitmask[0] = -1  # an unrestricted row
    bitmask[1] = 0  # nothing allowed
    bitmask[2, ::2] = 0  # whole words forbidden between mixed ones
    bitmask[3, 1::2] = -1  # whole words allowed between mixed ones
    allow_only(bitmask, 4, vocab_size - 1)  # a grammar's row: one token, in the last word
    expected = apply_token_bitmask_reference(logits, bitmask)
    masked = apply_token_bitmask(logits.clone(), bitmask)
    assert torch.equal(masked, expected)
    assert torch.equal(masked[0], logits[0]) and not masked[1:].isfinite().all()
    assert masked[4].isfinite().nonzero().flatten().tolist() == [vocab_size - 1]


def test_structured_outputs_params_is_public():
    import shardline
    from shardline.engine.params import StructuredOutputsParams

    assert shardline.StructuredOutputsParams is StructuredOutputsParams
