"""A job's structured-output constraint: one JSON schema, regex, choice list or grammar
for every row (rows may override it, tasks/structured_rows.py).

The job's constraint is checked when the job is built: exactly one kind is set, a
JSON schema is a valid JSON Schema (the ``jsonschema`` package's check) and every
constraint parses in xgrammar, the engine's grammar engine. A job whose constraint
could never run is refused before any shard starts, in one line naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardline.engine.params import StructuredOutputsParams

_KINDS = ("json_schema", "regex", "choice", "grammar", "json_object")


class StructuredOutputs(BaseModel):
    """Constrain every completion of the job (vLLM's StructuredOutputsParams, one of its
    constraints): a JSON schema, a regex, a list of choices, an EBNF grammar, or any
    JSON object. JSON outputs are validated after decoding into the ``parsed`` column."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict[str, Any] | str | None = Field(
        default=None, description="A JSON Schema (an object, or its JSON text) every output must match.")
    regex: str | None = Field(default=None, description="A regular expression every output must match in full.")
    choice: list[str] | None = Field(default=None, description="Every output is exactly one of these strings.")
    grammar: str | None = Field(default=None, description="An EBNF grammar (xgrammar's dialect, rule `root`).")
    json_object: bool | None = Field(
        default=None, description="Every output is some JSON object (OpenAI's json_object).")
    disable_any_whitespace: bool = Field(default=False, description="Compact JSON: no whitespace between tokens.")

    @model_validator(mode="after")
    def _one_valid_constraint(self) -> StructuredOutputs:
        set_kinds = [kind for kind in _KINDS if getattr(self, kind) is not None]
        if len(set_kinds) != 1:
            raise ValueError(f"set exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(set_kinds) if set_kinds else 'none'}")
        if isinstance(self.json_schema, str):
            self.json_schema = schema_object(self.json_schema)
        check_constraint(self.params())
        return self

    def params(self) -> StructuredOutputsParams:
        """The engine's StructuredOutputsParams for this constraint."""
        try:
            return StructuredOutputsParams(json=self.json_schema, regex=self.regex, choice=self.choice,
                                           grammar=self.grammar, json_object=self.json_object,
                                           disable_any_whitespace=self.disable_any_whitespace)
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix("structured_outputs.")) from None


def schema_object(text: str) -> dict[str, Any]:
    """The JSON Schema object written as ``text``; ValueError if it is not a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not valid JSON ({exc.msg} at position {exc.pos}): {text!r:.80}") \
            from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON schema must be a JSON object, got {type(value).__name__} {value!r:.80}")
    return value


def check_constraint(params: StructuredOutputsParams) -> None:
    """ValueError naming the reason if ``params`` can never run: a JSON schema that is
    not a valid JSON Schema, or a constraint xgrammar cannot parse."""
    from shardline.engine.sampling.structured import grammar_key, parse_grammar

    if params.json is not None:
        check_json_schema(params.json)
    parse_grammar(grammar_key(params))  # StructuredOutputError (a ValueError) with xgrammar's reason


def check_json_schema(schema: Any) -> None:
    """ValueError if ``schema`` is not a valid JSON Schema for its declared draft."""
    import jsonschema.validators

    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be a JSON object, got {type(schema).__name__} {schema!r:.80}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/" + "/".join(str(part) for part in exc.absolute_path)
        raise ValueError(f"invalid JSON schema at {where}: {exc.message}") from None
