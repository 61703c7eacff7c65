"""Structured outputs and reasoning in the pipeline: a job's constraint and each row's
override reach the engine, every output is checked after decoding into `parsed`, an
output that does not validate is a counted row error, and reasoning gets its column."""

from __future__ import annotations

import json
import re

import jsonschema
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.outputs import CompletionOutput
from shardline.engine.params import StructuredOutputsParams
from shardline.tasks.engine_cache import close_engines
from shardline.tasks.errors import ModelUnusable
from shardline.tasks.fingerprint import fingerprint_fields
from shardline.tasks.preflight import check_model, field_errors
from shardline.tasks.sample_data import write_rows
from shardline.tasks.shard_job import process_shard
from shardline.tasks.storage import list_shards
from shardline.tasks.structured_rows import OutputChecker
from shardline.tasks.summary import job_summary, shard_entry, summary_table

from ..schemas import LABELS, ORDER, PERSON


@pytest.fixture(autouse=True)
def _close_engines():
    """Overrides the package's per-test close: this module's jobs share their engines,
    which _engines_of_this_module closes at its end."""
    yield


@pytest.fixture(scope="module", autouse=True)
def _engines_of_this_module():
    yield
    close_engines()


TOPICS = ["The quick brown fox", "Summarize the text", "café 東京", "def main():", "Two plus two?", "emoji 🙂"]


def _run(tmp_path, rows, job, name="run"):
    """Run ``rows`` as the one shard of ``job`` over tmp_path/<name>; (manifest, output table)."""
    job = job.model_copy(update={"input": str(tmp_path / name / "in"), "output": str(tmp_path / name / "out")})
    write_rows(str(tmp_path / name / "in" / "part-0.jsonl"), rows)
    manifest = process_shard(list_shards(job.input)[0], job)
    return manifest, pq.read_table(tmp_path / name / "out" / "part-0.parquet")


def _schema_rows() -> tuple[list[dict], list[dict | None]]:
    """9 rows: the job's schema, a json_schema column and OpenAI's response_format;
    and each row's schema (None: unconstrained)."""
    rows, schemas = [], []
    for i in range(9):
        row = {"id": f"r{i}", "prompt": f"Row {i}: {TOPICS[i % len(TOPICS)]}"}
        schema = PERSON
        if i % 3 == 1:
            row["json_schema"], schema = json.dumps(ORDER), ORDER
        elif i % 3 == 2:
            row["response_format"] = json.dumps({"type": "json_schema",
                                                 "json_schema": {"name": "labels", "schema": LABELS}})
            schema = LABELS
        rows.append(row)
        schemas.append(schema)
    rows[4]["max_tokens"] = 4  # cut by max_tokens: its JSON is incomplete
    rows[5]["response_format"], schemas[5] = json.dumps({"type": "text"}), None
    return rows, schemas


def test_schema_job_outputs_parse_and_validate_and_cut_rows_are_counted(tmp_path, make_job):
    rows, schemas = _schema_rows()
    job = make_job(sampling={"max_tokens": 160, "temperature": 1.0, "seed": 0},
                   structured_outputs={"json_schema": PERSON, "disable_any_whitespace": True})
    manifest, table = _run(tmp_path, rows, job)
    assert table.column_names == ["id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "parsed",
                                  "error"]
    out = table.to_pylist()
    cut = out[4]
    assert cut["finish_reason"] == "length" and cut["parsed"] is None and cut["text"]
    assert cut["error"].startswith("max_tokens ended the output before its json constraint was complete "
                                   "(finish_reason 'length'; raise max_tokens): the output is not valid JSON: ")
    assert out[5]["error"] is None and out[5]["parsed"] is None  # type text: unconstrained
    for row, schema in zip(out, schemas):
        if row["id"] in ("r4", "r5"):
            continue
        assert row["finish_reason"] == "stop" and row["error"] is None, row
        value = json.loads(row["parsed"])
        jsonschema.validate(value, schema)
        assert json.loads(row["text"]) == value
    assert (manifest.errors, manifest.invalid_outputs) == (1, 1)
    summary = job_summary([shard_entry("part-0", "done", manifest)], 1.0, "out")
    assert (summary["totals"]["errors"], summary["totals"]["invalid_outputs"]) == (1, 1)
    assert "1 of the 1 row error(s) are structured outputs that did not validate" in summary_table(summary)


def test_a_bad_override_is_a_row_error_and_the_shard_goes_on(tmp_path, make_job):
    rows = [
        {"prompt": "a", "json_schema": '{"type": "object", "properties": {"n": {"minimum": "zero"}}}'},
        {"prompt": "b", "json_schema": "{not json"},
        {"prompt": "c", "response_format": {"type": "xml"}},
        {"prompt": "d", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"prompt": "e", "json_schema": '{"type": "string", "pattern": "a+", "maxLength": 3}'},
        {"prompt": "f", "json_schema": "{}", "response_format": {"type": "text"}},
        {"prompt": "g", "json_schema": '{"type": "object", "properties": {"n": {"type": "integer"}}, '
                                       '"required": ["n"]}'},
    ]
    manifest, table = _run(tmp_path, rows, make_job(sampling={"max_tokens": 40, "temperature": 0.0}))
    errors = table.column("error").to_pylist()
    assert errors[0] == "json_schema: invalid JSON schema at /properties/n/minimum: 'zero' is not of type 'number'"
    assert errors[1].startswith("json_schema: the JSON schema is not valid JSON (")
    assert errors[2] == "response_format: type must be 'json_schema', 'json_object' or 'text', got 'xml'"
    assert errors[3].startswith("response_format: type json_schema needs json_schema.schema")
    assert errors[4].startswith("json_schema: the json constraint does not compile: ")
    assert errors[5] == "set response_format or json_schema, not both"
    assert errors[6] is None and isinstance(json.loads(table.column("parsed")[6].as_py())["n"], int)
    assert (manifest.rows, manifest.errors, manifest.invalid_outputs) == (7, 6, 0)


def test_choice_and_regex_jobs(tmp_path, make_job):
    rows = [{"prompt": f"Row {i}: {TOPICS[i % len(TOPICS)]}"} for i in range(5)]
    choices = ["positive", "negative", "neutral"]
    job = make_job(sampling={"max_tokens": 16, "temperature": 1.0, "seed": 3}, structured_outputs={"choice": choices})
    manifest, table = _run(tmp_path, rows, job)
    assert set(table.column("text").to_pylist()) <= set(choices) and manifest.errors == 0
    assert table.column("parsed").to_pylist() == [None] * 5  # no JSON to parse

    pattern = r"[A-Z]{2}-\d{3}( [a-z]+)?"
    rows[0]["max_tokens"] = 2
    job = make_job(sampling={"max_tokens": 16, "temperature": 1.0, "seed": 3}, structured_outputs={"regex": pattern})
    manifest, table = _run(tmp_path, rows, job, name="regex")
    out = table.to_pylist()
    assert out[0]["finish_reason"] == "length" and out[0]["error"].endswith(
        f"the output {out[0]['text']!r} does not match the regex in full")
    for row in out[1:]:
        assert row["error"] is None and re.fullmatch(pattern, row["text"]), row
    assert manifest.invalid_outputs == 1


def test_unconstrained_rows_equal_a_job_without_constraints(tmp_path, make_job):
    free = [{"id": f"f{i}", "prompt": f"Free row {i}: {TOPICS[i]}", "max_tokens": 10} for i in range(3)]
    constrained = [{"id": f"c{i}", "prompt": f"Row {i}", "json_schema": json.dumps(LABELS)} for i in range(3)]
    mixed = [row for pair in zip(constrained, free) for row in pair]
    job = make_job(sampling={"max_tokens": 24, "temperature": 0.0})
    _, alone = _run(tmp_path, free, job, name="free")
    _, together = _run(tmp_path, mixed, job, name="mixed")
    texts = dict(zip(together.column("id").to_pylist(), together.column("text").to_pylist()))
    assert [texts[row["id"]] for row in free] == alone.column("text").to_pylist()


def test_output_checker_catches_what_decoding_alone_does_not():
    checker = OutputChecker()

    def check(text, finish_reason="stop", **constraint):
        sample = CompletionOutput(0, text, [], None, None, finish_reason=finish_reason)
        return checker.check(sample, StructuredOutputsParams(**constraint))

    assert check('{"name": "x", "age": 3, "score": 1.5}', json=PERSON) == ('{"name":"x","age":3,"score":1.5}', None)
    # A stop string cut the JSON: finish_reason is "stop", the text still does not parse.
    assert check('{"name": "x", "age"', json=PERSON)[1].startswith("the output is not valid JSON")
    assert check('{"name": "x", "age": 300, "score": 0}', json=PERSON)[1] == (
        "the output does not match the JSON schema at /age: 300 is greater than the maximum of 120")
    assert check('{"n": 1e999}', json={"type": "object"})[1] == (
        "the output is not usable JSON: the number 1e999 is beyond a 64-bit float's range")
    assert check("[1]", json_object=True)[1] == "the output is JSON list, not an object"
    assert check("maybe", choice=["yes", "no"])[1] == "the output 'maybe' is not one of the choices ['yes', 'no']"
    assert check("AB-12", regex=r"[A-Z]{2}-\d{3}")[1] == "the output 'AB-12' does not match the regex in full"
    assert check("AB-123", regex=r"[A-Z]{2}-\d{3}") == (None, None)
    assert check("aab", grammar='root ::= "a" root | "b"') == (None, None)
    assert "finish_reason 'length'" in check("aa", "length", grammar='root ::= "a" root | "b"')[1]


def test_job_constraint_and_reasoning_fields_are_checked_in_one_line(make_job):
    cases = [
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
         "structured_outputs: set exactly one of json_schema, regex, choice, grammar, json_object; got regex, choice"),
        ({"structured_outputs": {"json_schema": {"type": "objekt"}}},
         "structured_outputs: invalid JSON schema at /type: 'objekt' is not valid under any of the given schemas"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs: the grammar constraint does not "
                                                             "compile: "),
        ({"task": "embed", "structured_outputs": {"choice": ["a"]}},
         "job: structured_outputs applies to generate and chat jobs, not task=embed"),
        ({"reasoning_parser": "o1"},
         "reasoning_parser: reasoning_parser must be one of qwen3, deepseek_r1, openai_gptoss, got 'o1'"),
        ({"sampling": {"max_reasoning_tokens": 8}}, "job: sampling.max_reasoning_tokens=8 needs a reasoning_parser"),
        ({"engine_options": {"reasoning_parser": "qwen3"}},
         "job: set reasoning_parser as the job's own field, not in engine_options"),
    ]
    for fields, line in cases:
        with pytest.raises(ValidationError) as caught:
            make_job(**fields)
        [reported] = field_errors(caught.value)
        assert reported.startswith(line), reported


def test_fingerprint_follows_the_constraint_and_leaves_other_jobs_alone(tmp_path, make_job):
    write_rows(str(tmp_path / "in" / "part-0.jsonl"), [{"prompt": "a"}])
    shard = list_shards(str(tmp_path / "in"))[0]
    plain = fingerprint_fields(make_job(), shard, {})
    assert "structured_outputs" not in plain and "max_reasoning_tokens" not in plain["sampling"]
    one = fingerprint_fields(make_job(structured_outputs={"choice": ["a", "b"]}), shard, {})
    other = fingerprint_fields(make_job(structured_outputs={"choice": ["a", "c"]}), shard, {})
    assert one["structured_outputs"]["choice"] == ["a", "b"] and one != other


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-thinking"), "qwen3",
                                extra_special_tokens=["<think>", "</think>"]))


def test_reasoning_gets_its_column_and_the_constraint_applies_to_the_answer(tmp_path, make_job, thinking_model):
    rows = [{"prompt": f"Question {i}: {TOPICS[i]}"} for i in range(4)]
    job = make_job(model=thinking_model, reasoning_parser="deepseek_r1",
                   sampling={"max_tokens": 40, "temperature": 1.0, "seed": 1, "max_reasoning_tokens": 6},
                   structured_outputs={"choice": ["yes", "no"]})
    check_model(job)  # the pre-flight check finds the think tags
    manifest, table = _run(tmp_path, rows, job)
    assert table.column_names[-4:] == ["parsed", "reasoning", "reasoning_tokens", "error"]
    for row in table.to_pylist():
        assert row["error"] is None and row["text"] in ("yes", "no"), row
        assert isinstance(row["reasoning"], str) and "<think>" not in row["reasoning"]
        assert 0 < row["reasoning_tokens"] < row["completion_tokens"], row
    assert manifest.reasoning_tokens == sum(table.column("reasoning_tokens").to_pylist())
    assert manifest.job["reasoning_parser"] == "deepseek_r1"

    with pytest.raises(ModelUnusable, match="needs the tokens <think> and </think>"):
        check_model(make_job(reasoning_parser="qwen3"))  # the tiny llama has no think tags


def test_n_samples_get_a_parsed_list_and_each_is_checked(tmp_path, make_job):
    rows = [{"prompt": "Row 0: json"}, {"prompt": "Row 1: json", "max_tokens": 3}]
    job = make_job(sampling={"max_tokens": 40, "temperature": 1.0, "seed": 5, "n": 2},
                   structured_outputs={"json_object": True, "disable_any_whitespace": True})
    manifest, table = _run(tmp_path, rows, job)
    whole, cut = table.to_pylist()
    assert len(whole["parsed"]) == len(whole["texts"]) == 2
    for text, parsed, reason in zip(whole["texts"], whole["parsed"], whole["finish_reason"]):
        assert reason == "length" or json.loads(parsed) == json.loads(text)
    assert cut["parsed"] == [None, None] and cut["error"].startswith("sample 0: max_tokens ended the output")
    assert "; sample 1: max_tokens ended the output" in cut["error"]
    assert manifest.invalid_outputs == 1 + (whole["error"] is not None)
