"""OpenAI Batch files in and out: request lines mapped onto the engine, every output line
checked against the openai package's own types, bad lines as error lines, usage sums."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from shardline import LLM, SamplingParams
from shardline.tasks.openai_requests import OpenAIRow
from shardline.tasks.shard_job import process_shard, read_shard
from shardline.tasks.shard_reader import ShardError
from shardline.tasks.storage import list_shards

from ..openai_lines import read_output_lines

CHAT = [{"role": "user", "content": "Hello there"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}}}


def request(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_lines(tmp_path, lines: list, name: str = "part-0.jsonl") -> None:
    (tmp_path / "in").mkdir(exist_ok=True)
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    (tmp_path / "in" / name).write_text(text)


def read_output(path) -> list[dict]:
    return read_output_lines(path.read_text())


def run_one_shard(tmp_path, job) -> dict:
    return process_shard(list_shards(job.input)[0], job)


def test_mixed_file_every_line_validates_and_bad_lines_become_error_lines(tmp_path, make_job, tiny_model):
    lines = [
        request("chat", "/v1/chat/completions", model=tiny_model, messages=CHAT, max_completion_tokens=6,
                temperature=0, logprobs=True, top_logprobs=2),
        request("text", "/v1/completions", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2, n=2),
        request("sampled", "/v1/completions", prompt=["The sea"], max_tokens=4, temperature=0.7, seed=3,
                presence_penalty=0.5, frequency_penalty=0.2, logit_bias={"7": -100}, stop=["zz"], user="u1"),
        request("tool", "/v1/chat/completions", messages=CHAT, max_tokens=24, tools=[TOOL],
                tool_choice={"type": "function", "function": {"name": "lookup"}}),
        request("embedding", "/v1/embeddings", input="a sentence"),
        request("prompts", "/v1/completions", prompt=["Once upon a time", "The sea"], max_tokens=3, n=2,
                temperature=0),
        "{not json",
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "no id"}},
        request("url", "/v1/audio/speech", input="hi"),
        request("hot", "/v1/chat/completions", messages=CHAT, temperature=2.5),
        request("audio", "/v1/chat/completions", messages=CHAT, audio={"voice": "alloy"}),
        request("other-model", "/v1/chat/completions", model="gpt-4o-mini", messages=CHAT),
    ]
    write_lines(tmp_path, lines)
    job = make_job(output_format="openai", sampling={"max_tokens": 8, "temperature": 0.0})
    manifest = run_one_shard(tmp_path, job)
    out = read_output(tmp_path / "out" / "part-0.jsonl")

    assert [line["custom_id"] for line in out] == [
        "chat", "text", "sampled", "tool", "embedding", "prompts", None, None, "url", "hot", "audio", "other-model"]
    ok = {line["custom_id"]: line["response"]["body"] for line in out if line["error"] is None}
    assert sorted(ok) == ["chat", "prompts", "sampled", "text", "tool"]

    llm = LLM(tiny_model)
    chat = ok["chat"]["choices"][0]
    expected = llm.chat([CHAT], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].outputs[0]
    assert chat["message"]["content"] == expected.text and chat["finish_reason"] == expected.finish_reason
    positions = chat["logprobs"]["content"]
    assert len(positions) == ok["chat"]["usage"]["completion_tokens"] == len(expected.token_ids)
    assert all(len(p["top_logprobs"]) == 2 and p["top_logprobs"][0]["logprob"] == p["logprob"] for p in positions)

    text = ok["text"]
    expected = llm.generate(["Once upon a time"], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert [choice["text"] for choice in text["choices"]] == [expected.outputs[0].text] * 2
    assert text["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert text["usage"]["completion_tokens"] == 2 * len(expected.outputs[0].token_ids)
    assert len(text["choices"][0]["logprobs"]["tokens"]) == len(expected.outputs[0].token_ids)

    both = llm.generate(["Once upon a time", "The sea"], SamplingParams(max_tokens=3, temperature=0),
                        use_tqdm=False)
    prompts = ok["prompts"]  # two prompts, n=2: choices 0-1 answer the first, 2-3 the second
    assert [(c["index"], c["text"]) for c in prompts["choices"]] == [
        (0, both[0].outputs[0].text), (1, both[0].outputs[0].text), (2, both[1].outputs[0].text),
        (3, both[1].outputs[0].text)]
    assert prompts["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in both)

    call = ok["tool"]["choices"][0]["message"]
    assert call["content"] is None and call["tool_calls"][0]["function"]["name"] == "lookup"

    errors = {line["custom_id"]: line for line in out if line["error"] is not None}
    assert errors["embedding"]["error"]["code"] == "unsupported_endpoint"
    assert "needs an embedding model" in errors["embedding"]["error"]["message"]
    unparsed = [line for line in out if line["custom_id"] is None]
    assert [line["error"]["code"] for line in unparsed] == ["invalid_json", "missing_custom_id"]
    assert all(line["response"] is None for line in unparsed)
    assert errors["url"]["error"]["code"] == "invalid_url" and "/v1/responses" in errors["url"]["error"]["message"]
    hot = errors["hot"]["response"]
    assert hot["status_code"] == 400 and hot["body"]["error"]["param"] == "temperature"
    assert "2.5" in errors["hot"]["error"]["message"]
    assert errors["audio"]["error"]["code"] == "unsupported_parameter" and "'audio'" in errors["audio"]["error"][
        "message"]
    assert errors["other-model"]["error"]["code"] == "model_not_found"

    failed = [line for line in out if line["error"] is not None]
    assert read_output(tmp_path / "out" / "part-0.errors.jsonl") == failed
    usage = [body["usage"] for body in ok.values()]
    assert manifest.rows == len(lines) and manifest.errors == len(failed)
    assert manifest.prompt_tokens == sum(u["prompt_tokens"] for u in usage)
    assert manifest.completion_tokens == sum(u["completion_tokens"] for u in usage)
    assert manifest.cached_prompt_tokens == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert manifest.endpoints == ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


def test_embedding_requests_with_an_embedding_model(tmp_path, make_job, embedding_model):
    lines = [
        request("a", "/v1/embeddings", input="a sentence about the sea", model=embedding_model),
        request("b", "/v1/embeddings", input=["another one"], encoding_format="base64", dimensions=32),
        request("chat", "/v1/chat/completions", messages=CHAT),
        request("many", "/v1/embeddings", input=["one", "two"]),
    ]
    write_lines(tmp_path, lines)
    job = make_job(task="embed", model=embedding_model, engine_options={}, output_format="openai",
                   served_model_name="all-MiniLM-L6-v2")
    manifest = run_one_shard(tmp_path, job)
    out = read_output(tmp_path / "out" / "part-0.jsonl")

    expected = LLM(embedding_model).embed(["a sentence about the sea"], use_tqdm=False)[0]
    first = out[0]["response"]["body"]
    assert first["model"] == "all-MiniLM-L6-v2"
    assert first["data"][0]["embedding"] == pytest.approx(expected.outputs.embedding, abs=1e-5)
    assert first["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    packed = out[1]["response"]["body"]["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(packed), dtype="<f4").shape == (32,)
    assert out[2]["error"]["code"] == "unsupported_endpoint" and "needs a generative model" in out[2]["error"][
        "message"]
    many = out[3]["response"]["body"]  # one line, two inputs: two embeddings in input order
    both = LLM(embedding_model).embed(["one", "two"], use_tqdm=False)
    assert [item["index"] for item in many["data"]] == [0, 1]
    for item, expected in zip(many["data"], both):
        assert item["embedding"] == pytest.approx(expected.outputs.embedding, abs=1e-5)
    assert many["usage"]["prompt_tokens"] == sum(len(e.prompt_token_ids) for e in both)
    ok = [line for line in out if line["error"] is None]
    assert manifest.prompt_tokens == sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in ok)
    assert manifest.completion_tokens == 0 and manifest.errors == 1


def test_duplicate_custom_ids_fail_the_shard_naming_them(tmp_path, make_job):
    write_lines(tmp_path, [request(name, "/v1/completions", prompt="hi") for name in ("a", "b", "a", "c", "b")])
    with pytest.raises(ShardError, match=r"duplicate custom_id value\(s\) 'a', 'b'"):
        run_one_shard(tmp_path, make_job(output_format="openai"))
    assert not (tmp_path / "out" / "part-0.jsonl").exists()


def test_request_bodies_map_onto_engine_parameters(tmp_path, make_job):
    schema = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}}}
    good = [
        request("defaults", "/v1/chat/completions", messages=CHAT),
        request("fields", "/v1/chat/completions", messages=CHAT, max_completion_tokens=9, temperature=0.5,
                top_p=0.9, n=2, stop="END", seed=7, logit_bias={"12": 5}, logprobs=True,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                tools=[TOOL], chat_template_kwargs={"enable_thinking": False}, top_k=5),
        request("object", "/v1/completions", prompt="p", response_format={"type": "json_object"}, logprobs=0),
        request("required", "/v1/chat/completions", messages=CHAT, tools=[TOOL], tool_choice="required"),
    ]
    bad = {  # custom_id -> (body fields, the field the error names, a fragment of its message)
        "top": ({"messages": CHAT, "top_logprobs": 3}, "top_logprobs", "needs logprobs=true"),
        "stops": ({"messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        "n0": ({"messages": CHAT, "n": 0}, "n", "integer in [1, 128]"),
        "bias": ({"messages": CHAT, "logit_bias": {"3": 200}}, "logit_bias", "[-100, 100]"),
        "both": ({"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "not both"),
        "stream": ({"messages": CHAT, "stream": True}, "stream", "stream=true"),
        "format": ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format", "'xml'"),
        "choice": ({"messages": CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
        "messages": ({"messages": "hi"}, "messages", "non-empty list"),
        "image": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                  "messages", "image URL 'x' has no scheme"),
        "audio": ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
                  "messages", "message 0: a 'input_audio' part carries audio input"),
        "tokens": ({"max_tokens": 0, "messages": CHAT}, "max_tokens", "integer >= 1"),
    }
    lines = good + [request(name, "/v1/chat/completions", **body) for name, (body, _, _) in bad.items()]
    lines.append(request("best", "/v1/completions", prompt="p", best_of=3))
    lines.append(request("ids", "/v1/completions", prompt=[101, 102]))
    lines.append(request("two", "/v1/completions", prompt=["p", "q"]))
    write_lines(tmp_path, lines, "requests.jsonl")
    job = make_job(sampling={"max_tokens": 11, "temperature": 0.0, "top_p": 0.8}, output_format="openai")
    rows = {row.custom_id: row for row in read_shard(list_shards(job.input)[0], job).rows}
    assert all(isinstance(row, OpenAIRow) for row in rows.values())

    defaults = rows["defaults"].request.params
    assert (defaults.max_tokens, defaults.temperature, defaults.top_p) == (11, 0.0, 1.0)  # greedy resets top_p
    fields = rows["fields"].request
    params = fields.params
    assert (params.max_tokens, params.temperature, params.top_p, params.n, params.stop, params.seed) == \
        (9, 0.5, 0.9, 2, ["END"], 7)
    assert params.logit_bias == {12: 5.0} and params.logprobs == 0 and params.top_k == 5
    assert params.structured_outputs.json == schema
    assert fields.chat_options == {"tools": [TOOL], "chat_template_kwargs": {"enable_thinking": False}}
    assert rows["object"].request.params.structured_outputs.json_object is True
    assert rows["object"].logprobs == 0 and rows["object"].kind == "text_completion"
    required = rows["required"].request.params.structured_outputs.json
    assert required["type"] == "array" and required["items"]["anyOf"][0]["properties"]["name"] == {"enum": ["lookup"]}
    assert rows["required"].tool_mode == "required"

    for name, (_, param, fragment) in bad.items():
        row = rows[name]
        assert row.request is None and row.param == param and fragment in row.error, (name, row.error)
    assert rows["best"].param == "best_of" and rows["best"].error_code == "unsupported_parameter"
    assert rows["ids"].param == "prompt" and "token ids" in rows["ids"].error
    requests = rows["two"].engine_requests()  # a list prompt: one engine request per text
    assert [r.prompt for r in requests] == ["p", "q"] and len({r.index for r in requests}) == 2
    assert requests[1].index >= len(lines)  # after every row's own index

    # A Parquet output holds the job's n texts per row and no logprobs: such requests fail, naming why.
    rows = {row.custom_id: row for row in read_shard(list_shards(job.input)[0], make_job()).rows}
    assert rows["defaults"].error is None and rows["required"].error is None
    assert rows["fields"].param == "n" and "--output-format openai" in rows["fields"].error
    assert rows["object"].param == "logprobs" and "Parquet" in rows["object"].error
    assert rows["two"].param == "prompt" and "holds 2 texts" in rows["two"].error


def test_detection_by_content_and_parquet_input_answered_as_openai_lines(tmp_path, make_job, tiny_model):
    write_lines(tmp_path, [request("a", "/v1/completions", prompt="The sea", max_tokens=3)], "batch.jsonl")
    job = make_job()
    assert isinstance(read_shard(list_shards(job.input)[0], job).rows[0], OpenAIRow)
    with pytest.raises(ShardError, match="no 'prompt' column"):
        read_shard(list_shards(job.input)[0], make_job(input_format="jsonl"))

    # Plain prompt rows, one long shared prefix: run one at a time, later rows reuse its cached blocks.
    prefix = "A long shared instruction that every row repeats word for word. " * 2
    write_lines(tmp_path, [{"id": f"r{i}", "prompt": prefix + str(i)} for i in range(3)], "batch.jsonl")
    job = make_job(output_format="openai", engine_options={"max_num_seqs": 1, "block_size": 16})
    manifest = run_one_shard(tmp_path, job)
    out = read_output(tmp_path / "out" / "batch.jsonl")
    assert [line["custom_id"] for line in out] == ["r0", "r1", "r2"]
    assert {line["response"]["body"]["object"] for line in out} == {"text_completion"}
    cached = [line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for line in out]
    assert cached[0] == 0 and cached[1] > 0 and manifest.cached_prompt_tokens == sum(cached)
    assert (tmp_path / "out" / "batch.errors.jsonl").read_text() == ""
