"""Tools in an OpenAI chat request body, or in a chat row's ``tools`` and ``tool_choice``
columns: the constraint and the engine's tool choice.

A named or ``required`` ``tool_choice`` forces tool calls: the output is constrained to
the tool's parameters (named) or to a list of ``{name, parameters}`` calls (required),
as compact JSON (a call's arguments are data, and free whitespace is where a model
drifts until max_tokens cuts the call). With tools, ``auto`` (or no tool_choice) lets
the model call them in its own format, which the engine's tool-call parser reads;
``none`` offers them to the template and reads no calls. ``parallel_tool_calls: false``
allows one call (the required list holds one; more from the model is a botched call).
"""

from __future__ import annotations

import json
from typing import Any

from shardline import StructuredOutputsParams
from shardline.engine.tools import ToolChoice


class ToolFieldError(ValueError):
    """A ``tools`` or ``tool_choice`` value that cannot be used; ``param`` names the field."""

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(problem)
        self.param = param


def tool_request(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, ToolChoice | None]:
    """The constraint and the tool choice of a chat body's ``tools`` and ``tool_choice``."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise ToolFieldError("tools", f"must be a list of {{'type': 'function', 'function': {{'name': ...}}}}, "
                             f"got {tools!r:.80}")
    functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools or []}
    names = tuple(functions)
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise ToolFieldError("parallel_tool_calls", f"must be true or false, got {parallel!r:.40}")
    parallel = parallel is not False
    if choice == "none" or (choice in (None, "auto") and not functions):
        return None, None
    if choice in (None, "auto"):
        return None, ToolChoice("auto", names, parallel=parallel, parameters=functions)
    if not functions:
        raise ToolFieldError("tool_choice", f"{choice!r:.80} needs tools")
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": parameters},
                  "required": ["name", "parameters"]} for name, parameters in functions.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if parallel else {"maxItems": 1})}
        return (StructuredOutputsParams(json=array, disable_any_whitespace=True),
                ToolChoice("required", names, parallel=parallel))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name not in functions:
        raise ToolFieldError("tool_choice", f"must be 'none', 'auto', 'required' or a function among the tools "
                             f"({', '.join(functions)}), got {choice!r:.80}")
    return (StructuredOutputsParams(json=functions[name], disable_any_whitespace=True),
            ToolChoice("named", names, name))


def row_tools(record: dict[str, Any], constraint: StructuredOutputsParams | None) \
        -> tuple[StructuredOutputsParams | None, ToolChoice | None, dict[str, Any]]:
    """A chat row's ``tools`` and ``tool_choice`` columns (as OpenAI writes them, either as
    objects or as their JSON text, which keeps differently shaped tools apart in Parquet):
    the row's constraint, its tool choice and the chat options that show the template
    the tools. ValueError naming the column when they cannot be used, or when a forced
    call meets the row's other constraint."""
    body = {name: _json_value(record.get(name), name) for name in ("tools", "tool_choice")}
    try:
        forced, choice = tool_request(body)
    except ToolFieldError as exc:
        raise ValueError(f"{exc.param} {exc}") from None
    if forced is not None and constraint is not None:
        raise ValueError(f"tool_choice {body['tool_choice']!r:.60} forces a tool call, which cannot be combined with "
                         "the row's structured-output constraint (response_format, json_schema or the job's)")
    return forced or constraint, choice, {"tools": body["tools"]}


def _json_value(value: Any, name: str) -> Any:
    """A column's value, decoded when it is JSON text (a bare tool_choice such as auto is kept)."""
    if not isinstance(value, str) or value in ("none", "auto", "required"):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is a string that is not JSON ({exc.msg}): {value!r:.80}") from None
