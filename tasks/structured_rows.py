"""Structured outputs in the pipeline: each row's constraint, and each output checked
after decoding.

A row's constraint is the job's ``structured_outputs`` unless the row overrides it:
a ``response_format`` column in OpenAI's shape (``{"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}}}``, ``{"type": "json_object"}``, or
``{"type": "text"}`` for no constraint), or a ``json_schema`` column holding the
schema itself; either as an object or as its JSON text (in Parquet, JSON text keeps
differently shaped schemas apart: a struct column would merge their keys). A row's
own schema follows the job's ``disable_any_whitespace``. A row whose override is not
a valid constraint gets an error naming it; its shard goes on.

The engine constrains decoding, but an output can still fail its constraint: a
sample cut by ``max_tokens`` (finish_reason "length") or by a stop string before its
grammar completed. So every constrained output is checked after decoding: JSON
against its schema (``jsonschema``), a choice by membership, a regex or grammar by
xgrammar over the output's bytes. A JSON output that passes goes to the ``parsed``
column as compact JSON text; one that fails keeps its text and gets an error saying
why, and is counted in the manifest's ``invalid_outputs``. OpenAI Batch output lines
(``output_format`` openai) are not checked, as OpenAI's API does not check them: a
line carries the content as written and its ``finish_reason`` says whether it was cut.

Invariant: a row with an ``error`` and a ``finish_reason`` ran on the engine and its
output did not validate; only this module sets an error on a row that has output.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardline.engine.params import StructuredOutputsParams

from .job import BatchJob, JobTask
from .structured_job import check_constraint, schema_object

if TYPE_CHECKING:
    import pyarrow as pa

    from shardline.engine.sampling.structured import GrammarKey

# The input columns that override a row's constraint.
OVERRIDE_COLUMNS = ("response_format", "json_schema")
_JSON_KINDS = ("json", "json_object")


class RowConstraints:
    """Each row's constraint for one shard of ``job``. A constraint shared by many rows
    is checked once (the result, or its error, is kept by its text)."""

    def __init__(self, job: BatchJob) -> None:
        self._default = job.structured_outputs.params() if job.structured_outputs is not None else None
        # A row's own JSON schema follows the job's choice of compact JSON.
        self._compact = job.structured_outputs is not None and job.structured_outputs.disable_any_whitespace
        self._checked: dict[str, StructuredOutputsParams | ValueError | None] = {}

    def of(self, record: dict[str, Any]) -> StructuredOutputsParams | None:
        """The constraint of the row ``record`` (None: unconstrained); ValueError naming
        the override column and the reason when its override cannot run."""
        given = [name for name in OVERRIDE_COLUMNS if record.get(name) is not None]
        if not given:
            return self._default
        if len(given) > 1:
            raise ValueError("set response_format or json_schema, not both")
        name = given[0]
        value = record[name]
        cache_key = name + "\0" + (value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str))
        if cache_key not in self._checked:
            try:
                self._checked[cache_key] = self._parse(name, value)
            except ValueError as exc:
                self._checked[cache_key] = ValueError(f"{name}: {exc}")
        checked = self._checked[cache_key]
        if isinstance(checked, ValueError):
            raise checked
        return checked

    def _parse(self, name: str, value: Any) -> StructuredOutputsParams | None:
        if name == "json_schema":
            params = StructuredOutputsParams(json=_object(value))
        else:
            params = _response_format(_object(value))
        if params is not None:
            params.disable_any_whitespace = self._compact
            check_constraint(params)
        return params


def _object(value: Any) -> dict[str, Any]:
    return schema_object(value) if isinstance(value, str) else _require_object(value)


def _require_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object (or its JSON text), got {type(value).__name__} {value!r:.80}")
    return value


def _response_format(value: dict[str, Any]) -> StructuredOutputsParams | None:
    """OpenAI's response_format as a constraint (None for type "text")."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError(f"type json_schema needs json_schema.schema, a JSON Schema object; got "
                             f"json_schema={spec!r:.80}")
        return StructuredOutputsParams(json=spec["schema"])
    raise ValueError(f"type must be 'json_schema', 'json_object' or 'text', got {kind!r}")


def has_structured_rows(job: BatchJob, input_columns: dict[str, str]) -> bool:
    """Whether a shard's output has a ``parsed`` column: the job has a constraint, or
    the shard has a column that may give its rows one."""
    return job.structured_outputs is not None or any(name in input_columns for name in OVERRIDE_COLUMNS)


@dataclass
class CheckedOutputs:
    """The ``parsed`` and ``reasoning`` columns of a shard, and each row's validation error."""

    columns: dict[str, pa.Array] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # row index -> why its output is invalid


def check_outputs(rows: list[Any], outputs: list[Any], job: BatchJob, input_columns: dict[str, str]) -> CheckedOutputs:
    """Check every constrained output of a shard's ``rows`` (PreparedRows; ``outputs``
    are the engine's RequestOutputs or None, in the same order) and build its
    ``parsed`` column (when has_structured_rows) and ``reasoning`` column (when the job
    has a reasoning parser), lists of strings when the job samples n > 1, with beside it
    ``reasoning_tokens``, each row's thinking tokens over all its samples."""
    import pyarrow as pa

    checker = OutputChecker()
    checked = CheckedOutputs()
    n = job.sampling.n
    if job.task == JobTask.EMBED:
        return checked
    parsed: list[list[str | None] | None] = []
    for row, output in zip(rows, outputs):
        constraint = getattr(row.request.params, "structured_outputs", None) if row.request is not None else None
        if output is None:
            parsed.append(None)
            continue
        if constraint is None:
            unparsed: list[str | None] = [None] * len(output.outputs)
            parsed.append(unparsed)
            continue
        values, problems = [], []
        for sample in output.outputs:
            value, problem = checker.check(sample, constraint)
            values.append(value)
            if problem is not None:
                problems.append(problem if len(output.outputs) == 1 else f"sample {sample.index}: {problem}")
        parsed.append(values)
        if problems:
            checked.errors[row.index] = "; ".join(problems)
    column_type = pa.string() if n == 1 else pa.list_(pa.string())

    def column(values: list[list[str | None] | None]) -> pa.Array:
        return pa.array([v if v is None or n > 1 else v[0] for v in values], column_type)

    if has_structured_rows(job, input_columns):
        checked.columns["parsed"] = column(parsed)
    if job.reasoning_parser is not None:
        checked.columns["reasoning"] = column(
            [None if o is None else [sample.reasoning for sample in o.outputs] for o in outputs])
        # Thinking tokens per row (all samples together), as usage's reasoning_tokens counts them.
        checked.columns["reasoning_tokens"] = pa.array(
            [None if o is None else sum(sample.num_reasoning_tokens for sample in o.outputs) for o in outputs],
            pa.int64())
    return checked


def count_invalid_outputs(table: pa.Table) -> int:
    """Rows that ran but whose output did not validate: an error beside a finish_reason."""
    if "finish_reason" not in table.column_names:
        return 0
    return sum(error is not None and reason is not None for error, reason in
               zip(table.column("error").to_pylist(), table.column("finish_reason").to_pylist()))


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text:.40} is beyond a 64-bit float's range")
    return value


def _no_constant(text: str) -> None:
    raise ValueError(f"{text} is not a JSON number")


class OutputChecker:
    """Checks outputs against their constraints; keeps each schema's validator and each
    regex's or grammar's byte-level matcher grammar, so a shared constraint is prepared once."""

    def __init__(self) -> None:
        self._validators: dict[str, Any] = {}
        self._grammars: dict[GrammarKey, Any] = {}
        self._compiler: Any = None

    def check(self, sample: Any, constraint: StructuredOutputsParams) -> tuple[str | None, str | None]:
        """(the parsed JSON as compact text, or None; why the sample is invalid, or None)."""
        parsed, problem = self._check(sample.text, constraint)
        if problem is not None and sample.finish_reason == "length":
            problem = (f"max_tokens ended the output before its {constraint.kind} constraint was complete "
                       f"(finish_reason 'length'; raise max_tokens): {problem}")
        return parsed, problem

    def _check(self, text: str, constraint: StructuredOutputsParams) -> tuple[str | None, str | None]:
        if constraint.kind in _JSON_KINDS:
            try:
                value = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
            except json.JSONDecodeError as exc:
                return None, f"the output is not valid JSON: {exc}"
            except ValueError as exc:
                return None, f"the output is not usable JSON: {exc}"
            problem = self._json_problem(value, constraint)
            if problem is not None:
                return None, problem
            return json.dumps(value, ensure_ascii=False, separators=(",", ":")), None
        if constraint.kind == "choice":
            assert constraint.choice is not None, "a choice constraint has its choices"
            if text in constraint.choice:
                return None, None
            return None, f"the output {text!r:.80} is not one of the choices {constraint.choice!r:.200}"
        if constraint.kind in ("regex", "grammar"):
            if self._grammar_accepts(constraint, text):
                return None, None
            return None, f"the output {text!r:.80} does not match the {constraint.kind} in full"
        return None, None  # structural tags: nothing to check the whole output against

    def _json_problem(self, value: Any, constraint: StructuredOutputsParams) -> str | None:
        if constraint.kind == "json_object":
            return None if isinstance(value, dict) else f"the output is JSON {type(value).__name__}, not an object"
        assert constraint.json is not None, "a json constraint has its schema"
        schema = constraint.json if isinstance(constraint.json, dict) else schema_object(constraint.json)
        validator = self._validator(schema)
        error = next(iter(sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))), None)
        if error is None:
            return None
        where = "/" + "/".join(str(part) for part in error.absolute_path)
        return f"the output does not match the JSON schema at {where}: {error.message:.200}"

    def _validator(self, schema: dict[str, Any]) -> Any:
        import jsonschema.validators

        key = json.dumps(schema, sort_keys=True)
        if key not in self._validators:
            self._validators[key] = jsonschema.validators.validator_for(schema)(schema)
        return self._validators[key]

    def _grammar_accepts(self, constraint: StructuredOutputsParams, text: str) -> bool:
        """Whether the constraint's grammar accepts all of ``text``: xgrammar's matcher
        over a vocabulary of the 256 single bytes, so any output can be fed byte by byte."""
        import xgrammar as xgr

        from shardline.engine.sampling.structured import grammar_key, parse_grammar

        key = grammar_key(constraint)
        if key not in self._grammars:
            if self._compiler is None:
                vocabulary = xgr.TokenizerInfo([bytes([byte]) for byte in range(256)])
                self._compiler = xgr.GrammarCompiler(vocabulary, max_threads=1, cache_enabled=False)
            self._grammars[key] = self._compiler.compile_grammar(parse_grammar(key))
        matcher = xgr.GrammarMatcher(self._grammars[key], terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_completed()
