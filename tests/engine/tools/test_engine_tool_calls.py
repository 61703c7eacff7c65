"""Tool calls through the engine: a tiny model constrained to a call comes out with the
call read into CompletionOutput.tool_calls (after its reasoning, whose tokens are
counted), LLM.chat offers tools to the parser its chat template implies, and a request
the engine cannot read calls for is refused."""

from __future__ import annotations

import json

import pytest

from shardline import LLM, SamplingParams
from shardline.engine.config import ConfigError
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.params import StructuredOutputsParams
from shardline.engine.tools import ToolChoice, ToolParserError

CALL_SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["lookup"]},
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}},
    "required": ["name", "parameters"]}
HERMES_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>Call a tool as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>{% for tool in tools %}{{ tool | tojson }}{% endfor %}<|end|>{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
CONSTRAINT = StructuredOutputsParams(json=CALL_SCHEMA, disable_any_whitespace=True)
ARGUMENTS = StructuredOutputsParams(json=CALL_SCHEMA["properties"]["parameters"], disable_any_whitespace=True)
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-thinking-tools"), "qwen3",
                                extra_special_tokens=["<think>", "</think>"]))


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory) -> str:
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-hermes"), "llama",
                            extra_special_tokens=["<tool_call>", "</tool_call>"])
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return str(path)


def test_a_constrained_call_after_reasoning_is_read_and_its_reasoning_counted(thinking_dir):
    llm = LLM(thinking_dir, dtype="float64", max_num_seqs=4, reasoning_parser="deepseek_r1",
              tool_call_parser="llama3_json")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=60, max_reasoning_tokens=5,
                                structured_outputs=CONSTRAINT,
                                tool_choice=ToolChoice("auto", ("lookup",)))
        outputs = llm.generate(["Question: the weather in Oslo?", "café"], params, use_tqdm=False)
        for output in outputs:
            sample = output.outputs[0]
            assert sample.finish_reason == "stop" and sample.num_reasoning_tokens == 5
            assert sample.tool_calls is not None and sample.tool_calls.error is None
            [call] = sample.tool_calls.calls
            written = json.loads(sample.text)
            assert call.name == "lookup" and json.loads(call.arguments) == written["parameters"]
            assert sample.tool_calls.content is None
        # The same request without a tool choice: the same tokens, no calls read.
        plain = llm.generate(["café"], SamplingParams(temperature=0.0, max_tokens=60, max_reasoning_tokens=5,
                             structured_outputs=CONSTRAINT), use_tqdm=False)[0]
        assert plain.outputs[0].token_ids == outputs[1].outputs[0].token_ids and plain.outputs[0].tool_calls is None
    finally:
        llm.close()


def test_chat_with_tools_reads_calls_by_the_templates_parser(hermes_dir):
    llm = LLM(hermes_dir, dtype="float64", max_num_seqs=4)
    try:
        engine = llm.llm_engine
        assert isinstance(engine, LLMEngine) and engine.tool_parser is not None and engine.tool_parser.name == "hermes"
        chat = [{"role": "user", "content": "Weather in Oslo?"}]
        [with_tools] = llm.chat([chat], SamplingParams(temperature=0.0, max_tokens=8), tools=[TOOL], use_tqdm=False)
        [without] = llm.chat([chat], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        sample = with_tools.outputs[0]
        assert sample.tool_calls is not None and sample.tool_calls.error is None
        assert sample.tool_calls.content == (sample.text.strip() or None) and not sample.tool_calls.calls
        assert without.outputs[0].tool_calls is None

        def weather(city: str) -> str:
            """The weather in a city.

            Args:
                city: the city's name
            """
            return city

        [with_function] = llm.chat([chat], SamplingParams(temperature=0.0, max_tokens=4), tools=[TOOL, weather],
                                   use_tqdm=False)
        assert with_function.outputs[0].tool_calls is not None
        with pytest.raises(ValueError, match="tools must be OpenAI function tools .* or Python functions, got 42"):
            llm.chat([chat], SamplingParams(max_tokens=4), tools=[42], use_tqdm=False)  # pyright: ignore[reportArgumentType]
    finally:
        llm.close()


def test_an_auto_tool_choice_without_a_parser_is_refused(tiny_model):
    llm = LLM(tiny_model, max_num_seqs=2)
    try:
        assert isinstance(llm.llm_engine, LLMEngine) and llm.llm_engine.tool_parser is None
        with pytest.raises(ValueError, match="has no tool_call_parser"):
            llm.generate(["hi"], SamplingParams(tool_choice=ToolChoice("auto")), use_tqdm=False)
        # A forced call needs no parser: its JSON is the constraint's.
        [output] = llm.generate(["hi"], SamplingParams(
            temperature=0.0, max_tokens=40, tool_choice=ToolChoice("named", ("lookup",), "lookup"),
            structured_outputs=ARGUMENTS),
            use_tqdm=False)
        sample = output.outputs[0]
        assert sample.tool_calls is not None and sample.finish_reason == "stop"
        calls = [(call.name, json.loads(call.arguments)) for call in sample.tool_calls.calls]
        assert calls == [("lookup", json.loads(sample.text))]
    finally:
        llm.close()


def test_tool_call_parser_is_checked(tiny_model):
    with pytest.raises(ConfigError, match="tool_call_parser must be one of"):
        LLM(tiny_model, tool_call_parser="pythonic_v9")
    with pytest.raises(ToolParserError, match=r"needs the token \[TOOL_CALLS\]"):
        LLM(tiny_model, tool_call_parser="mistral")
