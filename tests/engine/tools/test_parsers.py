"""Every tool-call format's parser against transcripts of that format: one call, several,
calls beside text, malformed calls (the answer kept, the reason given), and markers
written in ordinary tokens (no call: the formats with special tokens are read on them)."""

from __future__ import annotations

import json

import pytest

from shardline.engine.model.tiny import build_tokenizer
from shardline.engine.tools import ToolChoice, ToolParserError, make_tool_parser, read_tool_calls
from shardline.engine.tools.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

SPECIAL = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", CALLS_BEGIN,
           CALLS_END, CALL_BEGIN, CALL_END, SEP, "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>",
           "<|call|>", "<|return|>"]
PARAMETERS = {"lookup": {"type": "object", "properties": {"city": {"type": "string"}}},
              "add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
AUTO = ToolChoice("auto", ("lookup", "add"), parameters=PARAMETERS)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tools-tokenizer"), extra_special_tokens=SPECIAL)


def parse(tokenizer, name: str, transcript: str, choice: ToolChoice = AUTO):
    token_ids = tokenizer.encode(transcript, add_special_tokens=False)
    answer = tokenizer.decode(token_ids, skip_special_tokens=False)
    return read_tool_calls(make_tool_parser(name, tokenizer), choice, token_ids, answer)


def calls(output) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in output.calls]


OSLO = '{"name": "lookup", "arguments": {"city": "Oslo"}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
# name -> (one call, two calls, a call beside text, a malformed call) as the model writes them.
TRANSCRIPTS = {
    "hermes": (
        f"<tool_call>\n{OSLO}\n</tool_call><|eos|>",
        f"<tool_call>\n{OSLO}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call><|eos|>",
        f"Let me look. <tool_call>{OSLO}</tool_call><|eos|>",
        '<tool_call>{"name": "lookup", "arguments": {"city": </tool_call><|eos|>',
    ),
    "llama3_json": (
        '{"name": "lookup", "parameters": {"city": "Oslo"}}<|eos|>',
        '{"name": "lookup", "parameters": {"city": "Oslo"}}; {"name": "add", "parameters": {"a": 1, "b": 2}}',
        'Let me look. <|python_tag|>{"name": "lookup", "parameters": {"city": "Oslo"}}',
        '{"name": "lookup", "parameters": {"city": "Os',
    ),
    "mistral": (
        f"[TOOL_CALLS][{OSLO}]<|eos|>",
        '[TOOL_CALLS]lookup[ARGS]{"city": "Oslo"}[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1, "b": 2}',
        f"Let me look. [TOOL_CALLS][{OSLO}]",
        "[TOOL_CALLS]lookup[ARGS]city=Oslo",
    ),
    "deepseek_v3": (
        f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}lookup\n```json\n{{"city": "Oslo"}}\n```{CALL_END}{CALLS_END}',
        f'{CALLS_BEGIN}{CALL_BEGIN}lookup{SEP}{{"city": "Oslo"}}{CALL_END}'
        f'{CALL_BEGIN}add{SEP}{{"a": 1, "b": 2}}{CALL_END}{CALLS_END}<|eos|>',
        f'Let me look. {CALLS_BEGIN}{CALL_BEGIN}lookup{SEP}{{"city": "Oslo"}}{CALL_END}{CALLS_END}',
        f'{CALLS_BEGIN}{CALL_BEGIN}lookup{SEP}{{"city": "Oslo"{CALL_END}{CALLS_END}',
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=lookup>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call><|eos|>",
        "<tool_call>\n<function=lookup>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n"
        "</tool_call>",
        "Let me look. <tool_call>\n<function=lookup>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=add>\n<parameter=a>\none\n</parameter>\n</function>\n</tool_call>",
    ),
    "openai": (
        '<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{"city": "Oslo"}<|call|>',
        '<|channel|>analysis<|message|>Two tools.<|end|><|start|>assistant to=functions.lookup<|channel|>commentary'
        ' json<|message|>{"city": "Oslo"}<|call|><|start|>assistant<|channel|>commentary to=functions.add'
        '<|message|>{"a": 1, "b": 2}<|call|>',
        '<|channel|>final<|message|>Let me look.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.lookup<|message|>{"city": "Oslo"}<|call|>',
        '<|channel|>commentary to=functions.lookup<|message|>{"city": Oslo}<|call|>',
    ),
}


@pytest.mark.parametrize("name", sorted(TRANSCRIPTS))
def test_one_call_several_calls_and_calls_beside_text(tokenizer, name):
    one, several, beside, _ = TRANSCRIPTS[name]
    output = parse(tokenizer, name, one)
    assert calls(output) == [("lookup", {"city": "Oslo"})] and output.content is None and output.error is None
    assert output.calls[0].id.startswith("call_") and len(output.calls[0].id) == 29

    output = parse(tokenizer, name, several)
    assert calls(output) == [("lookup", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]
    assert len({call.id for call in output.calls}) == 2

    output = parse(tokenizer, name, beside)
    assert calls(output) == [("lookup", {"city": "Oslo"})] and output.content == "Let me look."


@pytest.mark.parametrize("name", sorted(TRANSCRIPTS))
def test_a_malformed_call_is_reported_with_the_answer_kept(tokenizer, name):
    transcript = TRANSCRIPTS[name][3]
    output = parse(tokenizer, name, transcript)
    assert output.calls == () and output.error is not None and output.error.startswith("malformed tool call: ")
    assert output.content == tokenizer.decode(tokenizer.encode(transcript, add_special_tokens=False),
                                              skip_special_tokens=False)


@pytest.mark.parametrize("name", sorted(TRANSCRIPTS))
def test_plain_text_has_no_calls(tokenizer, name):
    output = parse(tokenizer, name, "The quick brown fox.<|eos|>" if name != "openai"
                   else "<|channel|>final<|message|>The quick brown fox.<|return|>")
    assert output.calls == () and output.error is None and output.content == "The quick brown fox."


def test_a_call_of_a_function_not_offered_is_malformed(tokenizer):
    output = parse(tokenizer, "hermes", '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>')
    assert output.calls == () and "'delete_all', which is not among the tools (lookup, add)" in (output.error or "")


def test_several_calls_where_one_is_allowed_are_malformed(tokenizer):
    one_at_most = ToolChoice("auto", ("lookup", "add"), parallel=False)
    output = parse(tokenizer, "hermes", TRANSCRIPTS["hermes"][1], one_at_most)
    assert output.calls == () and "made 2 calls, but parallel_tool_calls is false" in (output.error or "")
    assert len(parse(tokenizer, "hermes", TRANSCRIPTS["hermes"][0], one_at_most).calls) == 1


def test_markers_in_ordinary_tokens_open_no_call(tokenizer):
    # "<tool_call>" spelled out by byte tokens, not the special token: text, not a call.
    spelled = [token_id for char in f"<tool_call>{OSLO}</tool_call>"
               for token_id in tokenizer.encode(char, add_special_tokens=False)]
    assert tokenizer.convert_tokens_to_ids("<tool_call>") not in spelled
    parser = make_tool_parser("hermes", tokenizer)
    output = read_tool_calls(parser, AUTO, spelled, tokenizer.decode(spelled))
    assert output.calls == () and output.content == f"<tool_call>{OSLO}</tool_call>"


def test_hermes_reads_the_text_when_the_tokenizer_has_no_marker_tokens(tmp_path):
    plain = build_tokenizer(tmp_path)
    output = parse(plain, "hermes", f"Sure. <tool_call>{OSLO}</tool_call>")
    assert calls(output) == [("lookup", {"city": "Oslo"})] and output.content == "Sure."


def test_llama3_json_answer_that_is_no_call_stays_content(tokenizer):
    output = parse(tokenizer, "llama3_json", '{"answer": 4}')
    assert output.calls == () and output.error is None and output.content == '{"answer": 4}'


def test_a_last_call_left_open_counts_when_its_json_is_whole(tokenizer):
    output = parse(tokenizer, "hermes", f"<tool_call>{OSLO}<|eos|>")
    assert calls(output) == [("lookup", {"city": "Oslo"})]
    output = parse(tokenizer, "hermes", '<tool_call>{"name": "lookup", "argu')
    assert output.calls == () and "not closed" in (output.error or "")


def test_forced_calls_required_and_named(tokenizer):
    required = ToolChoice("required", ("lookup", "add"))
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "lookup", "parameters": {"city": "Rome"}}]'
    assert calls(read_tool_calls(None, required, [], text)) == [("add", {"a": 1, "b": 2}),
                                                                 ("lookup", {"city": "Rome"})]
    named = ToolChoice("named", ("lookup", "add"), "lookup")
    assert calls(read_tool_calls(None, named, [], '{"city": "Rome"}')) == [("lookup", {"city": "Rome"})]
    cut = read_tool_calls(None, named, [], '{"city": "Ro')
    assert cut.calls == () and cut.content == '{"city": "Ro' and "cut by max_tokens" in (cut.error or "")


def test_qwen3_xml_values_follow_the_parameter_schema(tokenizer):
    transcript = ("<tool_call>\n<function=add>\n<parameter=a>\n07\n</parameter>\n<parameter=note>\n[1, 2]\n"
                  "</parameter>\n</function>\n</tool_call>")
    choice = ToolChoice("auto", ("add",), parameters={"add": {"properties": {"a": {"type": "string"}}}})
    # A string parameter keeps its text ("07", not 7); one the schema does not type too.
    assert calls(parse(tokenizer, "qwen3_xml", transcript, choice)) == [("add", {"a": "07", "note": "[1, 2]"})]
    choice = ToolChoice("auto", ("add",), parameters={"add": {"properties": {"note": {"type": "array"}}}})
    output = parse(tokenizer, "qwen3_xml", transcript, choice)
    assert calls(output) == [("add", {"a": "07", "note": [1, 2]})]
    cut = parse(tokenizer, "qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1", choice)
    assert cut.calls == () and "not closed" in (cut.error or "")


def test_parsers_refuse_tokenizers_without_their_tokens(tmp_path):
    plain = build_tokenizer(tmp_path)
    for name, token in (("mistral", "[TOOL_CALLS]"), ("deepseek_v3", CALLS_BEGIN), ("openai", "<|call|>")):
        with pytest.raises(ToolParserError, match=token.replace("|", r"\|").replace("[", r"\[")):
            make_tool_parser(name, plain)
    with pytest.raises(ToolParserError, match="must be one of hermes, llama3_json"):
        make_tool_parser("pythonic_v9", plain)
    with pytest.raises(ValueError, match="not among the tools"):
        ToolChoice("named", ("lookup",), "add")


@pytest.mark.parametrize(("template", "name"), [
    ("{% for tool in tools %}<tool_call>{{ tool | tojson }}</tool_call>{% endfor %}", "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }}{% if message.tool_calls %}[TOOL_CALLS]{% endif %}", "mistral"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}", "deepseek_v3"),
    ("<|start|>assistant<|channel|>commentary to=functions.{{ name }}", "openai"),
    ("{%- if builtin_tools %}<|python_tag|>{% endif %}", "llama3_json"),
    ("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ("<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>", "qwen3_coder"),
])
def test_the_chat_template_names_the_parser(tmp_path, template, name):
    from shardline.engine.tools import detect_tool_parser

    plain = build_tokenizer(tmp_path)
    plain.chat_template = template
    assert detect_tool_parser(plain) == name
    plain.chat_template = {"default": "plain", "tool_use": template}
    assert detect_tool_parser(plain) == name
