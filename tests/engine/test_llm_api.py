"""The offline API behaves like vLLM's LLM class."""

from __future__ import annotations

import pytest

from shardline import LLM, SamplingParams
from shardline.engine.outputs import CompletionOutput, RequestOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def test_prompt_forms_give_the_same_tokens(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    ids = tokenizer("The quick brown fox").input_ids
    single = tiny_llm.generate("The quick brown fox", GREEDY, use_tqdm=False)
    forms = tiny_llm.generate(
        ["The quick brown fox", {"prompt": "The quick brown fox"}, {"prompt_token_ids": ids}], GREEDY,
        use_tqdm=False,
    )
    assert len(single) == 1 and len(forms) == 3
    assert {tuple(o.outputs[0].token_ids) for o in single + forms} == {tuple(single[0].outputs[0].token_ids)}
    assert forms[0].prompt == "The quick brown fox" and forms[2].prompt is None
    assert forms[2].prompt_token_ids == ids


def test_one_params_per_prompt(tiny_llm):
    outputs = tiny_llm.generate(
        ["a", "b", "c"], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 3)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3]


@pytest.mark.parametrize("option", ["sampling_params", "lora_request", "priority"])
def test_length_mismatch_names_both_lengths(tiny_llm, option):
    values = {"sampling_params": [GREEDY] * 2, "lora_request": [None] * 2, "priority": [0, 1]}
    with pytest.raises(ValueError, match=r"\(3\).*\(2\)"):
        tiny_llm.generate(["a", "b", "c"], use_tqdm=False, **{option: values[option]})
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_empty_prompt_list_returns_empty_list(tiny_llm):
    assert tiny_llm.generate([], GREEDY, use_tqdm=False) == []


def test_failed_add_aborts_requests_already_added(tiny_llm):
    too_long = {"prompt_token_ids": [5] * 2000}
    with pytest.raises(ValueError, match=r"2000.*1024|1024.*2000"):
        tiny_llm.generate(["fine", "also fine", too_long], GREEDY, use_tqdm=False)
    engine = tiny_llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    assert not engine.scheduler.has_unfinished_requests()
    [output] = tiny_llm.generate("fine", GREEDY, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 5


def test_request_ids_count_up_and_outputs_keep_input_order(tiny_llm):
    first = tiny_llm.generate(["x", "y"], GREEDY, use_tqdm=False)
    # Priorities make the later prompts run first; outputs still come in input order.
    prompts = [f"prompt number {i}" for i in range(6)]
    second = tiny_llm.generate(prompts, GREEDY, priority=[5, 4, 3, 2, 1, 0], use_tqdm=False)
    ids = [int(o.request_id) for o in first + second]
    assert ids == list(range(ids[0], ids[0] + 8))
    assert [o.prompt for o in second] == prompts
    assert all(o.finished for o in first + second)


def test_rendering_streams_into_the_engine(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float64", max_num_seqs=2)
    consumed = []
    consumed_at_first_step = []
    real_step = llm.llm_engine.step

    def recording_step():
        if not consumed_at_first_step:
            consumed_at_first_step.append(len(consumed))
        return real_step()

    llm.llm_engine.step = recording_step

    def prompts():
        for i in range(12):
            consumed.append(i)
            yield f"prompt {i}"

    outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert len(outputs) == 12
    assert consumed_at_first_step[0] < 12  # the engine stepped before rendering ended


class RecordingBar:
    """A tqdm-like progress bar whose clock reads one second."""

    instances: list[RecordingBar] = []

    def __init__(self, total=None, desc=None, **kwargs):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, kwargs.get("postfix")
        self.format_dict = {"elapsed": 1.0}
        self.closed = False
        RecordingBar.instances.append(self)

    def update(self, n=1):
        self.n += n

    def refresh(self):
        pass

    def close(self):
        self.closed = True


def test_progress_bar_counts_tokens_of_all_samples(tiny_llm):
    RecordingBar.instances.clear()
    params = SamplingParams(n=3, max_tokens=4, ignore_eos=True, seed=1)
    outputs = tiny_llm.generate(["one", "two"], params, use_tqdm=RecordingBar)
    [bar] = RecordingBar.instances
    assert bar.desc == "Processed prompts" and bar.total == 2 and bar.n == 2 and bar.closed
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    assert sum(len(c.token_ids) for o in outputs for c in o.outputs) == 24
    assert bar.postfix == f"est. speed input: {input_tokens:.2f} toks/s, output: 24.00 toks/s"


def test_no_progress_bar_when_disabled(tiny_llm, capsys):
    tiny_llm.generate("quiet", GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_progress_bar_by_default(tiny_llm, capsys):
    tiny_llm.generate("loud", GREEDY)
    assert "Processed prompts" in capsys.readouterr().err


def test_output_objects_carry_vllm_fields(tiny_llm):
    [output] = tiny_llm.generate("fields", SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2), use_tqdm=False)
    assert isinstance(output, RequestOutput)
    assert output.finished and output.metrics is not None and output.num_cached_tokens >= 0
    assert output.metrics.first_token_time >= output.metrics.arrival_time
    [completion] = output.outputs
    assert isinstance(completion, CompletionOutput)
    assert completion.index == 0 and completion.finish_reason == "length" and completion.stop_reason is None
    assert len(completion.logprobs) == 3 and completion.cumulative_logprob < 0
    assert completion.text == tiny_llm.get_tokenizer().decode(completion.token_ids)


def test_engine_streaming_api(tiny_llm):
    engine = tiny_llm.llm_engine
    engine.add_request("a", "first", GREEDY)
    engine.add_request("b", {"prompt": "second"}, GREEDY, priority=1)
    assert engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 2
    engine.abort_request("b")
    assert engine.get_num_unfinished_requests() == 1
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [o.request_id for o in finished] == ["a"]
    assert engine.step() == []


def test_priority_runs_lower_values_first(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float64", max_num_seqs=1)
    engine = llm.llm_engine
    for request_id, priority in [("late", 2), ("first", 0), ("second", 1), ("third", 1)]:
        engine.add_request(request_id, "same prompt", GREEDY, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step()]
    assert order == ["first", "second", "third", "late"]


def test_reset_prefix_cache_makes_a_repeated_prompt_compute_again(tiny_llm):
    prompt = {"prompt_token_ids": list(range(3, 60))}
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = tiny_llm.generate(prompt, params, use_tqdm=False)[0]
    repeated = tiny_llm.generate(prompt, params, use_tqdm=False)[0]
    assert repeated.num_cached_tokens >= 48 and repeated.outputs[0].token_ids == first.outputs[0].token_ids
    assert tiny_llm.reset_prefix_cache() is True
    after_reset = tiny_llm.generate(prompt, params, use_tqdm=False)[0]
    assert after_reset.num_cached_tokens == 0 and after_reset.outputs[0].token_ids == first.outputs[0].token_ids


def test_llm_drives_either_engine_through_the_engine_protocol(tiny_llama_dir, embedding_model):
    """LLM reaches no engine internals: both engines answer the same calls."""
    from shardline.engine.llm import Engine

    for llm, task in ((LLM(tiny_llama_dir, dtype="float32"), "generate"), (LLM(embedding_model), "embed")):
        engine = llm.llm_engine
        members = [name for name in vars(Engine) if not name.startswith("_")]
        assert engine.task == task and all(hasattr(engine, name) for name in members)
        assert engine.has_capacity() and not engine.has_unfinished_requests()
        llm.close()


def test_a_request_lost_by_the_engine_is_an_error_not_a_shorter_result(tiny_llama_dir, monkeypatch):
    llm = LLM(tiny_llama_dir, dtype="float32")
    engine = llm.llm_engine
    real_step = engine.step

    def step_dropping_request_1():
        outputs = real_step()
        engine.abort_request("1")  # as if the engine had lost it
        return [output for output in outputs if output.request_id != "1"]

    monkeypatch.setattr(engine, "step", step_dropping_request_1)
    with pytest.raises(RuntimeError, match=r"without an output for requests \['1'\]"):
        llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3), use_tqdm=False)
    llm.close()
