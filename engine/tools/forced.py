"""Calls whose shape a constraint forced (``tool_choice`` "required" or a named
function): not the model's own format but the JSON the grammar allowed, a list of
``{"name", "parameters"}`` objects or one function's arguments. Read from the answer
text; a sample cut before its JSON closed is reported malformed, its text kept."""

from __future__ import annotations

import json

from .calls import MalformedToolCall, ToolCall, ToolCallOutput, ToolChoice, arguments_text, call_from_object


def forced_calls(text: str, choice: ToolChoice) -> ToolCallOutput:
    """The calls of a sample constrained by ``choice`` (mode "required" or "named")."""
    assert choice.mode in ("required", "named"), f"auto calls are read by the model's parser, not {choice.mode!r}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedToolCall(f"the forced call's JSON does not parse ({exc}; was it cut by max_tokens?): "
                                f"{text.strip()[:120]!r}") from None
    if choice.mode == "named":
        assert choice.name is not None, "a named choice has its name"
        return ToolCallOutput(None, (ToolCall(choice.name, arguments_text(value, f"call of {choice.name!r}")),))
    if not isinstance(value, list) or not value:
        raise MalformedToolCall(f"the forced calls must be a non-empty JSON list, got {text.strip()[:120]!r}")
    return ToolCallOutput(None, tuple(call_from_object(item, f"call {number + 1}", ("parameters", "arguments"))
                                      for number, item in enumerate(value)))
