"""Sampling, stopping and detokenization for the engine-core issue."""

from __future__ import annotations

import json

import pytest

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.sampling.detokenizer import IncrementalDetokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_request_is_independent_of_batch_and_run(tiny_llm, tiny_llama_dir):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = tiny_llm.generate("seeded prompt", seeded, use_tqdm=False)
    noisy = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = tiny_llm.generate(
        ["other", "seeded prompt", "more noise here"], [noisy, seeded, noisy], use_tqdm=False
    )
    fresh = LLM(tiny_llama_dir, dtype="float64").generate("seeded prompt", seeded, use_tqdm=False)
    assert _tokens(alone)[0] == _tokens(mixed)[1] == _tokens(fresh)[0]


def test_different_seeds_and_unseeded_requests_differ(tiny_llm):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)]
    tokens = _tokens(tiny_llm.generate(["same"] * 4, params, use_tqdm=False))
    assert len({tuple(t) for t in tokens}) == 4
    unseeded = _tokens(tiny_llm.generate(["same"] * 4, SamplingParams(temperature=1.0, max_tokens=12,
                                                                        ignore_eos=True), use_tqdm=False))
    assert len({tuple(t) for t in unseeded}) > 1


def test_top_k_one_and_tiny_top_p_are_greedy(tiny_llm):
    greedy = _tokens(tiny_llm.generate(["alpha", "beta"], GREEDY, use_tqdm=False))
    top_k = SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True)
    top_p = SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8, ignore_eos=True)
    assert _tokens(tiny_llm.generate(["alpha", "beta"], top_k, use_tqdm=False)) == greedy
    assert _tokens(tiny_llm.generate(["alpha", "beta"], top_p, use_tqdm=False)) == greedy


def test_temperature_changes_the_distribution(tiny_llm):
    cold = SamplingParams(temperature=0.05, seed=3, max_tokens=8, ignore_eos=True)
    hot = SamplingParams(temperature=5.0, seed=3, max_tokens=8, ignore_eos=True)
    greedy = _tokens(tiny_llm.generate("warmth", GREEDY, use_tqdm=False))
    assert _tokens(tiny_llm.generate("warmth", cold, use_tqdm=False)) == greedy
    assert _tokens(tiny_llm.generate("warmth", hot, use_tqdm=False)) != greedy


def test_max_tokens_ends_with_length(tiny_llm):
    [output] = tiny_llm.generate("count", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3 and output.outputs[0].finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_llm):
    force_eos = {1: 100.0}
    [stopped] = tiny_llm.generate("end", SamplingParams(max_tokens=5, logit_bias=force_eos), use_tqdm=False)
    assert stopped.outputs[0].token_ids == [1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason is None
    [ignored] = tiny_llm.generate(
        "end", SamplingParams(max_tokens=5, logit_bias=force_eos, ignore_eos=True), use_tqdm=False
    )
    assert ignored.outputs[0].token_ids == [1] * 5 and ignored.outputs[0].finish_reason == "length"


def test_stop_token_ids(tiny_llm):
    params = SamplingParams(max_tokens=6, logit_bias={300: 100.0}, stop_token_ids=[300])
    [output] = tiny_llm.generate("stop here", params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.token_ids == [300] and completion.finish_reason == "stop" and completion.stop_reason == 300


def test_generation_config_eos_ids_stop(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", "llama")
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, 77]
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(model_dir), dtype="float64")
    [output] = llm.generate("x", SamplingParams(max_tokens=5, logit_bias={77: 100.0}), use_tqdm=False)
    assert output.outputs[0].token_ids == [77] and output.outputs[0].finish_reason == "stop"


def test_incremental_detokenization_keeps_multibyte_characters_whole(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    text = "東京 café 🙂🚀 Привет naïve"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text) / 2  # multi-byte characters span several tokens
    detokenizer = IncrementalDetokenizer(tokenizer, [0])
    deltas = [detokenizer.add_token(t) for t in ids]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_generated_text_equals_full_decode(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    outputs = tiny_llm.generate([f"sample {i}" for i in range(16)], params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_trimmed(tiny_llm, include):
    [reference] = tiny_llm.generate("stop strings", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                    use_tqdm=False)
    tokenizer = tiny_llm.get_tokenizer()
    token_texts = [tokenizer.decode(reference.outputs[0].token_ids[: i + 1]) for i in range(20)]
    full = reference.outputs[0].text
    # A stop string straddling the boundary between tokens 5 and 6.
    cut = len(token_texts[4])
    stop = full[cut - 1 : cut + 1]
    assert len(stop) == 2 and full.find(stop) == cut - 1
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=include)
    [output] = tiny_llm.generate("stop strings", params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == (full[: cut + 1] if include else full[: cut - 1])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_greedy_tokens_equal_torch_argmax(dtype):
    import torch

    from shardline.engine.sampling.sampler import greedy_tokens

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=generator, dtype=getattr(torch, dtype))
    logits[1, 10] = logits[1, 900] = 1e4  # a tie: the first index wins
    logits[2, 5] = logits[2, 7] = float("nan")  # NaN counts as the maximum
    logits[3] = float("-inf")
    logits[4, 999] = float("inf")
    want = logits.argmax(dim=-1)
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    assert got[1] == 10 and got[2] == 5 and got[3] == 0 and got[4] == 999
    strided = logits[::2, ::3]
    assert greedy_tokens(strided).tolist() == strided.argmax(dim=-1).tolist()


def test_plain_and_general_stop_checks_agree(tiny_llm):
    """The same requests with logprobs (appended by the general path) and without (the
    plain path): stop strings, stop token ids, EOS, min_tokens and lengths end them alike."""
    prompts = [f"stop checks {i}" for i in range(8)]
    reference = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                  use_tqdm=False)
    cases = []
    for i, output in enumerate(reference):
        text, token_ids = output.outputs[0].text, output.outputs[0].token_ids
        middle = len(text) // 2
        cases.append(dict(temperature=0, max_tokens=16 - i, ignore_eos=i % 4 == 0, min_tokens=i % 3,
                          stop=[text[middle : middle + 2]] if i % 3 and len(text) >= 4 else None,
                          stop_token_ids=[token_ids[4 + i]] if i % 2 else None,
                          include_stop_str_in_output=i % 4 == 1))
    plain = tiny_llm.generate(prompts, [SamplingParams(**case) for case in cases], use_tqdm=False)
    general = tiny_llm.generate(prompts, [SamplingParams(logprobs=0, **case) for case in cases], use_tqdm=False)
    ends = []
    for plain_output, general_output in zip(plain, general):
        a, b = plain_output.outputs[0], general_output.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                          b.stop_reason)
        ends.append(type(a.stop_reason).__name__ if a.finish_reason == "stop" else a.finish_reason)
    assert {"str", "int", "length"} <= set(ends)  # stop strings, stop token ids and lengths all ended some
