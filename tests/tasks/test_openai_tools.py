"""Tool calls and the Responses API through the shard pipeline: /v1/chat/completions and
/v1/responses lines whose output a tiny model is constrained to make a tool call, in
both output formats (every OpenAI line checked against the openai package's types),
botched calls reported per row with the text kept, and reasoning tokens counted in the
usage, the manifests and the batch object."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.engine.model.tiny import build_tiny_model
from shardline.tasks.shard_job import process_shard
from shardline.tasks.storage import list_shards
from shardline.tasks.summary import job_summary, shard_entry
from shardline.tasks.usage import batch_object

from ..openai_lines import read_output_lines

CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": CITY}}]
RESPONSE_TOOLS = [{"type": "function", "name": "lookup", "parameters": CITY}]


def call_schema(name: str) -> dict:
    """A llama3_json call of ``name``: what the tiny model is constrained to write."""
    return {"type": "object", "properties": {"name": {"enum": [name]}, "parameters": CITY},
            "required": ["name", "parameters"]}


def json_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "call", "schema": call_schema(name)}}


def request(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def run(tmp_path, job, lines: list[dict]):
    (tmp_path / "in").mkdir(exist_ok=True)
    (tmp_path / "in" / "part-0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return process_shard(list_shards(job.input)[0], job)


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-thinking-pipeline"), "qwen3",
                                extra_special_tokens=["<think>", "</think>"]))


def auto_lines() -> list[dict]:
    """Lines whose answer is constrained to a llama3_json call: chat and responses, one
    botched (it calls a function no tool offers), one answering in text. A frequency
    penalty keeps the random model from writing whitespace between JSON tokens until the
    length limit."""
    chat = [{"role": "user", "content": "Weather in Oslo?"}]
    return [
        request("chat", "/v1/chat/completions", messages=chat, tools=TOOLS, tool_choice="auto",
                response_format=json_format("lookup"), frequency_penalty=2.0),
        request("responses", "/v1/responses", input="Weather in Rome?", tools=RESPONSE_TOOLS, frequency_penalty=2.0,
                text={"format": {"type": "json_schema", "name": "call", "schema": call_schema("lookup")}}),
        request("botched", "/v1/chat/completions", messages=chat, tools=TOOLS, frequency_penalty=2.0,
                response_format=json_format("delete_all")),
        request("text", "/v1/responses", input=[{"role": "user", "content": "Say hi"}], max_output_tokens=3),
    ]


def thinking_job(make_job, thinking_model, output_format: str):
    return make_job(model=thinking_model, output_format=output_format, reasoning_parser="deepseek_r1",
                    tool_call_parser="llama3_json",
                    sampling={"max_tokens": 60, "temperature": 0.0, "max_reasoning_tokens": 3})


def test_auto_calls_after_reasoning_in_openai_lines(tmp_path, make_job, thinking_model):
    job = thinking_job(make_job, thinking_model, "openai")
    manifest = run(tmp_path, job, auto_lines())
    lines = {line["custom_id"]: line for line in read_output_lines((tmp_path / "out" / "part-0.jsonl").read_text())}

    chat = lines["chat"]["response"]["body"]
    choice = chat["choices"][0]
    assert lines["chat"]["error"] is None and choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"])["city"] in ("Oslo", "Rome")
    assert choice["message"]["content"] is None and choice["message"]["reasoning_content"]
    assert chat["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3

    response = lines["responses"]["response"]["body"]
    assert response["status"] == "completed" and response["tools"] == RESPONSE_TOOLS
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["reasoning", "function_call"]
    assert response["output"][1]["name"] == "lookup" and response["output"][1]["call_id"].startswith("call_")
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 3

    botched = lines["botched"]
    assert botched["error"]["code"] == "invalid_tool_call" and "'delete_all'" in botched["error"]["message"]
    message = botched["response"]["body"]["choices"][0]["message"]
    assert "tool_calls" not in message and json.loads(message["content"])["name"] == "delete_all"

    text = lines["text"]["response"]["body"]
    assert text["status"] == "incomplete" and text["incomplete_details"] == {"reason": "max_output_tokens"}
    assert text["usage"]["output_tokens"] == 3 and text["output"][0]["type"] == "reasoning"

    errors = read_output_lines((tmp_path / "out" / "part-0.errors.jsonl").read_text())
    assert [line["custom_id"] for line in errors] == ["botched"]
    assert manifest.reasoning_tokens == 3 * 4 and "/v1/responses" in manifest.endpoints
    assert manifest.errors == 1  # the botched call, whose tokens still count
    assert manifest.completion_tokens == sum(line["response"]["body"]["usage"].get(
        "completion_tokens", line["response"]["body"]["usage"].get("output_tokens")) for line in lines.values())
    batch = batch_object(job, job_summary([shard_entry("part-0", "done", manifest)], 1.0, job.output), 0.0)
    assert batch["usage"]["output_tokens_details"]["reasoning_tokens"] == 12


def test_auto_calls_in_a_parquet_output(tmp_path, make_job, thinking_model):
    job = thinking_job(make_job, thinking_model, "parquet")
    manifest = run(tmp_path, job, auto_lines())
    table = pq.read_table(tmp_path / "out" / "part-0.parquet").to_pylist()
    rows = {row["id"]: row for row in table}
    [call] = json.loads(rows["chat"]["tool_calls"])
    assert call["type"] == "function" and call["function"]["name"] == "lookup" and rows["chat"]["error"] is None
    assert json.loads(rows["responses"]["tool_calls"])[0]["function"]["name"] == "lookup"
    assert rows["botched"]["tool_calls"] is None and rows["botched"]["error"].startswith("malformed tool call")
    assert json.loads(rows["botched"]["text"])["name"] == "delete_all"
    assert rows["text"]["tool_calls"] is None and rows["text"]["error"] is None
    assert manifest.errors == 1 and manifest.reasoning_tokens == 12


def test_forced_calls_and_response_inputs(tmp_path, make_job):
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "user", "content": "And Rome?"},
    ]
    lines = [
        request("named", "/v1/responses", input=history, instructions="Be brief.", tools=RESPONSE_TOOLS,
                tool_choice={"type": "function", "name": "lookup"}, max_output_tokens=30, metadata={"k": "v"}),
        request("required", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                tool_choice="required", max_tokens=80, parallel_tool_calls=False),
        request("schema", "/v1/responses", input="Pick a city", text={"format": {
            "type": "json_schema", "name": "city", "schema": CITY}}, reasoning={"effort": "low"}),
        request("reasoning-item", "/v1/responses", input=[{"type": "reasoning", "summary": []}]),
        request("hosted", "/v1/responses", input="hi", tools=[{"type": "web_search"}]),
        request("previous", "/v1/responses", input="hi", previous_response_id="resp_1"),
    ]
    job = make_job(output_format="openai", sampling={"max_tokens": 30, "temperature": 0.0})
    run(tmp_path, job, lines)
    out = {line["custom_id"]: line for line in read_output_lines((tmp_path / "out" / "part-0.jsonl").read_text())}

    named = out["named"]["response"]["body"]
    assert out["named"]["error"] is None and named["instructions"] == "Be brief." and named["metadata"] == {"k": "v"}
    [call] = [item for item in named["output"] if item["type"] == "function_call"]
    assert call["name"] == "lookup" and json.loads(call["arguments"])["city"] in ("Oslo", "Rome")

    required = out["required"]["response"]["body"]["choices"][0]
    [forced] = required["message"]["tool_calls"]  # parallel_tool_calls false: one call at most
    assert required["finish_reason"] == "tool_calls" and forced["function"]["name"] == "lookup"

    schema = out["schema"]["response"]["body"]
    [message] = schema["output"]
    assert message["type"] == "message" and json.loads(message["content"][0]["text"])["city"] in ("Oslo", "Rome")
    assert schema["text"]["format"]["type"] == "json_schema" and schema["reasoning"] == {"effort": "low"}

    assert "type 'reasoning'" in out["reasoning-item"]["error"]["message"]
    assert out["hosted"]["error"]["code"] == "invalid_request"
    assert "no hosted tools" in out["hosted"]["error"]["message"]
    assert out["previous"]["error"]["code"] == "unsupported_parameter"
    assert out["previous"]["response"]["body"]["error"]["param"] == "previous_response_id"


def test_auto_without_a_parser_fails_the_row_not_the_shard(tmp_path, make_job):
    lines = [request("auto", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS),
             request("plain", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}])]
    run(tmp_path, make_job(output_format="openai"), lines)
    out = {line["custom_id"]: line for line in read_output_lines((tmp_path / "out" / "part-0.jsonl").read_text())}
    assert "has no tool_call_parser" in out["auto"]["error"]["message"] and out["plain"]["error"] is None


@pytest.mark.parametrize("input_format", ["jsonl", "parquet"])
@pytest.mark.parametrize("output_format", ["parquet", "openai"])
def test_chat_rows_with_a_tools_column(tmp_path, make_job, thinking_model, input_format, output_format):
    """Plain chat rows offer tools in columns (objects, or JSON text as Parquet keeps
    them); the job's compact constraint makes the tiny model write a llama3_json call."""
    chat = [{"role": "user", "content": "Weather in Oslo?"}]
    tools = json.dumps(TOOLS) if input_format == "parquet" else TOOLS
    rows = [
        {"id": "auto", "messages": chat, "tools": json.dumps(TOOLS), "tool_choice": "auto"},
        {"id": "default", "messages": [{"role": "user", "content": "café"}], "tools": tools, "tool_choice": None},
        {"id": "clash", "messages": chat, "tools": tools, "tool_choice": "required"},
        {"id": "plain", "messages": chat, "tools": None, "tool_choice": None},
        {"id": "bad", "messages": chat, "tools": "[{not json", "tool_choice": None},
    ]
    (tmp_path / "in").mkdir()
    if input_format == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in" / "part-0.parquet")
    else:
        (tmp_path / "in" / "part-0.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    job = make_job(model=thinking_model, task="chat", output_format=output_format, reasoning_parser="deepseek_r1",
                   tool_call_parser="llama3_json", structured_outputs={"json_schema": call_schema("lookup"),
                                                                       "disable_any_whitespace": True},
                   sampling={"max_tokens": 60, "temperature": 0.0, "max_reasoning_tokens": 3})
    manifest = process_shard(list_shards(job.input)[0], job)
    calls: dict[str, Any]
    errors: dict[str, Any]
    if output_format == "parquet":
        out = {row["id"]: row for row in pq.read_table(tmp_path / "out" / "part-0.parquet").to_pylist()}
        calls = {key: json.loads(row["tool_calls"]) if row["tool_calls"] else None for key, row in out.items()}
        errors = {key: row["error"] for key, row in out.items()}
    else:
        lines = read_output_lines((tmp_path / "out" / "part-0.jsonl").read_text())
        out = {line["custom_id"]: line for line in lines}
        calls = {key: line["response"]["body"]["choices"][0]["message"].get("tool_calls") if line["response"]
                 and line["response"]["status_code"] == 200 else None for key, line in out.items()}
        errors = {key: None if line["error"] is None else line["error"]["message"] for key, line in out.items()}
        assert out["auto"]["response"]["body"]["choices"][0]["finish_reason"] == "tool_calls"
    for key in ("auto", "default"):
        assert calls[key][0]["function"]["name"] == "lookup" and errors[key] is None
        assert json.loads(calls[key][0]["function"]["arguments"])["city"] in ("Oslo", "Rome")
    assert calls["clash"] is None and "cannot be combined with the row's structured-output" in errors["clash"]
    assert calls["plain"] is None and errors["plain"] is None  # no tools offered: the JSON is its text
    assert calls["bad"] is None and errors["bad"].startswith("tools is a string that is not JSON")
    assert manifest.reasoning_tokens == 3 * 3
