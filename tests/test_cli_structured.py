"""`shardline run`'s structured-output and reasoning flags become the job's fields; bad
ones are one line each and exit 2."""

from __future__ import annotations

import json

import pytest

from shardline.cli import build_parser, job_from_args, main

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def _job(*flags: str, model: str = "some/model"):
    return job_from_args(build_parser().parse_args(["run", "in", "out", "--model", model, *flags]))


def test_flags_set_the_jobs_constraint_and_reasoning(tmp_path):
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))
    job = _job("--json-schema", str(schema_file), "--compact-json", "--reasoning-parser", "qwen3",
               "--max-reasoning-tokens", "64")
    assert job.structured_outputs.json_schema == PERSON and job.structured_outputs.disable_any_whitespace
    assert job.reasoning_parser == "qwen3" and job.sampling.max_reasoning_tokens == 64
    assert job.engine_kwargs()["reasoning_parser"] == "qwen3"
    assert _job("--choice", "spam", "--choice", "ham").structured_outputs.choice == ["spam", "ham"]
    assert _job("--regex", r"\d+").structured_outputs.regex == r"\d+"
    grammar_file = tmp_path / "yes_no.ebnf"
    grammar_file.write_text('root ::= "yes" | "no"')
    assert _job("--grammar", str(grammar_file)).structured_outputs.grammar == 'root ::= "yes" | "no"'
    assert _job().structured_outputs is None and _job().reasoning_parser is None


def test_tool_call_parser_flag_sets_the_jobs_field():
    job = _job("--tool-call-parser", "hermes")
    assert job.tool_call_parser == "hermes" and job.engine_kwargs()["tool_call_parser"] == "hermes"
    assert _job().tool_call_parser is None and "tool_call_parser" not in _job().engine_kwargs()


@pytest.mark.parametrize("flags, line", [
    (["--regex", "a", "--choice", "b"], "shardline run: --choice and --regex cannot be combined: give one constraint"),
    (["--json-schema", "/no/such/schema.json"],
     "shardline run: --json-schema: cannot read /no/such/schema.json: No such file or directory"),
    (["--regex", "(("], "shardline run: --json-schema/--choice/--regex/--grammar: the regex constraint does not "
                        "compile: Regex parsing error at position 3: The parenthesis is not closed."),
    (["--reasoning-parser", "o1"],
     "shardline run: --reasoning-parser: reasoning_parser must be one of qwen3, deepseek_r1, openai_gptoss, "
     "got 'o1'"),
    (["--compact-json"], "shardline run: --compact-json needs --json-schema"),
    (["--tool-call-parser", "pythonic"],
     "shardline run: --tool-call-parser: tool_call_parser must be one of hermes, llama3_json, mistral, deepseek_v3, "
     "deepseek_v31, openai, qwen3_coder, qwen3_xml, got 'pythonic'"),
])
def test_bad_flags_are_one_line_and_exit_2(flags, line, capsys):
    assert main(["run", "in", "out", "--model", "some/model", *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_a_schema_file_that_is_not_a_schema(tmp_path, capsys):
    schema_file = tmp_path / "bad.json"
    schema_file.write_text('{"type": "objekt"}')
    assert main(["run", "in", "out", "--model", "some/model", "--json-schema", str(schema_file)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "shardline run: --json-schema/--choice/--regex/--grammar: invalid JSON schema at /type: 'objekt' is not "
        "valid under any of the given schemas"]
