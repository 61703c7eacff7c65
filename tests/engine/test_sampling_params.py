"""Every SamplingParams field means what it means in vLLM (issue: API completeness)."""

from __future__ import annotations

import pytest
import torch

from shardline import LLM, SamplingParams

from .hf_reference import load_hf_model


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir)


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V] float64 logits of transformers on one sequence."""
    return hf_model(torch.tensor([token_ids])).logits[0].double()


PROMPT = "The quick brown fox jumps"


def _one(llm, params, prompt=PROMPT):
    [output] = llm.generate(prompt, params, use_tqdm=False)
    return output


def test_logprobs_equal_hf_log_softmax(tiny_llm, hf_model):
    output = _one(tiny_llm, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))
    completion = output.outputs[0]
    tokens = output.prompt_token_ids + completion.token_ids
    reference = torch.log_softmax(hf_logits(hf_model, tokens), dim=-1)
    start = len(output.prompt_token_ids) - 1
    total = 0.0
    for step, position_logprobs in enumerate(completion.logprobs):
        row = reference[start + step]
        chosen = completion.token_ids[step]
        top = row.topk(3)
        assert set(position_logprobs) == set(top.indices.tolist()) | {chosen}
        for token_id, logprob in position_logprobs.items():
            assert abs(logprob.logprob - row[token_id].item()) < 1e-6
            assert logprob.rank == int((row > row[token_id]).sum()) + 1
        total += row[chosen].item()
    assert abs(completion.cumulative_logprob - total) < 1e-6


@pytest.mark.parametrize("budget", [8192, 5])
def test_prompt_logprobs_equal_hf(tiny_llama_dir, hf_model, budget):
    llm = LLM(tiny_llama_dir, dtype="float64", max_num_batched_tokens=budget)
    output = _one(llm, SamplingParams(max_tokens=1, prompt_logprobs=2))
    prompt = output.prompt_token_ids
    reference = torch.log_softmax(hf_logits(hf_model, prompt), dim=-1)
    assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        row = reference[position - 1]
        assert prompt[position] in entry
        assert set(row.topk(2).indices.tolist()) <= set(entry)
        for token_id, logprob in entry.items():
            assert abs(logprob.logprob - row[token_id].item()) < 1e-6


def reference_penalised_greedy(hf_model, prompt, steps, presence=0.0, frequency=0.0, repetition=1.0,
                               logit_bias=None):
    """A plain, per-token reference of vLLM's penalties and logit bias, greedy."""
    output = []
    for _ in range(steps):
        logits = hf_logits(hf_model, prompt + output)[-1].clone()
        for token_id, bias in (logit_bias or {}).items():
            logits[token_id] += bias
        for token_id in set(prompt) | set(output):
            value = logits[token_id]
            logits[token_id] = value / repetition if value > 0 else value * repetition
        for token_id in set(output):
            logits[token_id] -= frequency * output.count(token_id) + presence
        output.append(int(logits.argmax()))
    return output


@pytest.mark.parametrize("penalties", [
    # Negative presence/frequency values reward repeats, which a random model rarely
    # makes on its own, so they change the greedy path.
    {"presence": -2.0}, {"frequency": -1.5}, {"repetition": 1.8}, {"repetition": 0.5},
    {"presence": 1.0, "frequency": -1.5, "repetition": 1.3},
])
def test_penalties_match_reference(tiny_llm, hf_model, penalties):
    prompt = tiny_llm.get_tokenizer()(PROMPT).input_ids
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            presence_penalty=penalties.get("presence", 0.0),
                            frequency_penalty=penalties.get("frequency", 0.0),
                            repetition_penalty=penalties.get("repetition", 1.0))
    got = _one(tiny_llm, params).outputs[0].token_ids
    plain = _one(tiny_llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).outputs[0].token_ids
    assert got == reference_penalised_greedy(hf_model, prompt, 12, **penalties)
    assert got != plain  # the penalty changed something, so the test can fail


def test_logit_bias_matches_reference(tiny_llm, hf_model):
    prompt = tiny_llm.get_tokenizer()(PROMPT).input_ids
    bias = {100: 4.0, 200: 6.0, 300: -50.0}
    got = _one(tiny_llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias))
    assert got.outputs[0].token_ids == reference_penalised_greedy(hf_model, prompt, 8, logit_bias=bias)


def _first_tokens(llm, params_list):
    outputs = llm.generate([PROMPT] * len(params_list), params_list, use_tqdm=False)
    return [o.outputs[0].token_ids[0] for o in outputs]


@pytest.mark.parametrize("option", ["top_k", "top_p", "min_p"])
def test_truncation_never_samples_outside_its_support(tiny_llm, hf_model, option):
    prompt = tiny_llm.get_tokenizer()(PROMPT).input_ids
    temperature = 2.0
    probs = torch.softmax(hf_logits(hf_model, prompt)[-1] / temperature, dim=-1)
    order = probs.argsort(descending=True)
    if option == "top_k":
        value, support = 5, set(order[:5].tolist())
    elif option == "top_p":
        value = 0.3
        mass_before = probs[order].cumsum(0) - probs[order]
        support = set(order[mass_before < value].tolist())
    else:
        value = 0.2
        support = set((probs >= value * probs.max()).nonzero().flatten().tolist())
    assert 1 < len(support) < 200
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=1, **{option: value}) for s in range(300)]
    sampled = _first_tokens(tiny_llm, params)
    assert set(sampled) <= support
    assert len(set(sampled)) > 1
    unrestricted = _first_tokens(tiny_llm, [SamplingParams(temperature=temperature, seed=s, max_tokens=1)
                                            for s in range(300)])
    assert not set(unrestricted) <= support  # without the option the support is wider


def test_n_samples_share_one_prompt_computation(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float64", enable_prefix_caching=False)
    computed = []
    real_schedule = llm.llm_engine.scheduler.schedule

    def counting_schedule():
        output = real_schedule()
        computed.append(output.num_scheduled_tokens)
        return output

    llm.llm_engine.scheduler.schedule = counting_schedule
    prompt = {"prompt_token_ids": list(range(10, 50))}  # 40 tokens: 2 full blocks + 8
    [output] = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 4
    assert sum(computed) == 40 + 4 * (5 - 1)
    [greedy] = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
    [single] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert all(c.token_ids == single.outputs[0].token_ids for c in greedy.outputs)


def test_min_tokens_blocks_stop_tokens(tiny_llm):
    params = SamplingParams(max_tokens=10, min_tokens=3, logit_bias={1: 100.0})
    completion = _one(tiny_llm, params).outputs[0]
    assert len(completion.token_ids) == 4 and completion.token_ids[-1] == 1
    assert 1 not in completion.token_ids[:3] and completion.finish_reason == "stop"


def test_allowed_token_ids(tiny_llm):
    allowed = [40, 41, 42]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, allowed_token_ids=allowed) for s in range(8)]
    outputs = tiny_llm.generate([PROMPT] * 8, params, use_tqdm=False)
    seen = {t for o in outputs for t in o.outputs[0].token_ids}
    assert seen <= set(allowed) and len(seen) > 1


def test_bad_words_are_never_generated(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    plain = _one(tiny_llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)).outputs[0]
    word_ids = plain.token_ids[2:4]
    word = tokenizer.decode(word_ids)
    assert tokenizer(word, add_special_tokens=False).input_ids == word_ids
    banned = _one(tiny_llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words=[word]))
    tokens = banned.outputs[0].token_ids
    assert tokens[:3] == plain.token_ids[:3] and tokens != plain.token_ids
    assert all(tokens[i : i + 2] != word_ids for i in range(len(tokens) - 1))


def test_special_tokens_in_text(tiny_llm):
    bias = {3: 100.0}  # <|user|>
    kept = _one(tiny_llm, SamplingParams(max_tokens=2, logit_bias=bias, skip_special_tokens=False)).outputs[0]
    joined = _one(tiny_llm, SamplingParams(max_tokens=2, logit_bias=bias, skip_special_tokens=False,
                                           spaces_between_special_tokens=False)).outputs[0]
    skipped = _one(tiny_llm, SamplingParams(max_tokens=2, logit_bias=bias)).outputs[0]
    assert kept.text == "<|user|> <|user|>"
    assert joined.text == "<|user|><|user|>"
    assert skipped.text == "" and skipped.token_ids == [3, 3]


def test_detokenize_false_returns_tokens_only(tiny_llm):
    completion = _one(tiny_llm, SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False)).outputs[0]
    assert completion.text == "" and len(completion.token_ids) == 4
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("min_p", 1.5),
    ("min_tokens", -1), ("logprobs", -5), ("prompt_logprobs", "2"), ("seed", 1.5), ("stop_token_ids", [-1]),
    ("allowed_token_ids", []), ("stop", [""]),
])
def test_invalid_values_name_field_and_value(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_set_after_construction_as_one_string_is_one_stop_string(tiny_llm):
    """vLLM's fields take a bare string; a caller that sets one on an existing
    SamplingParams gets the same stop as passing it to the constructor."""
    free = tiny_llm.generate(["The quick brown fox"], SamplingParams(max_tokens=12, temperature=0.0))[0]
    text = free.outputs[0].text
    assert len(text) > 2
    stop = text[1:3]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    params.stop = stop
    stopped = tiny_llm.generate(["The quick brown fox"], params)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert text.startswith(stopped.text)
