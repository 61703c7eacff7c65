"""Qwen3-Coder's XML tool calls (vLLM's ``qwen3_coder`` and ``qwen3_xml``): each call
between ``<tool_call>`` and ``</tool_call>`` is ``<function=NAME>`` with one
``<parameter=KEY>`` ... ``</parameter>`` per argument, ``</function>``. A parameter's
value is text; it is typed by the offered function's parameter schema (a string stays
a string, a number, boolean, object or array is read as JSON), so the arguments are the
JSON the schema describes. The text before the first call is the content."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .calls import MalformedToolCall, ToolCall, ToolCallOutput, ToolChoice, content_or_none
from .markers import decode, single_token_id, split_ids, split_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_JSON_TYPES = ("integer", "number", "boolean", "object", "array", "null")


class Qwen3XmlParser:
    """XML calls inside ``<tool_call>`` markers, read on the marker tokens when the
    tokenizer has them."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, name: str = "qwen3_coder") -> None:
        self.name, self.tokenizer = name, tokenizer
        self.open_id, self.close_id = single_token_id(tokenizer, OPEN), single_token_id(tokenizer, CLOSE)

    def parse(self, token_ids: list[int], choice: ToolChoice) -> ToolCallOutput:
        if self.open_id is not None and self.close_id is not None:
            marked = split_ids(token_ids, self.open_id, self.close_id)
            outside = [decode(self.tokenizer, part) for part in marked.outside]
            bodies = [decode(self.tokenizer, body) for body in marked.bodies]
            closed = marked.closed
        else:
            text_marked = split_text(decode(self.tokenizer, token_ids), OPEN, CLOSE)
            outside, bodies, closed = text_marked.outside, text_marked.bodies, text_marked.closed
        calls = []
        for number, (body, is_closed) in enumerate(zip(bodies, closed)):
            where = f"{OPEN} call {number + 1}"
            if not is_closed:
                raise MalformedToolCall(f"{where} is not closed (the output was cut?): {body.strip()[:120]!r}")
            calls.append(_call(body, choice, where))
        return ToolCallOutput(content_or_none("".join(outside)), tuple(calls))


def _call(body: str, choice: ToolChoice, where: str) -> ToolCall:
    text = body.strip()
    if not text.startswith("<function=") or not text.endswith("</function>") or ">" not in text:
        raise MalformedToolCall(f"{where} must be <function=NAME> ... </function>, got {text[:120]!r}")
    name, _, rest = text.removeprefix("<function=").removesuffix("</function>").partition(">")
    name = name.strip()
    schema = choice.parameters.get(name) or {}
    properties = schema.get("properties") if isinstance(schema, dict) else None
    arguments: dict[str, Any] = {}
    while (start := rest.find("<parameter=")) >= 0:
        if rest[:start].strip():
            raise MalformedToolCall(f"{where}: text outside a parameter: {rest[:start].strip()[:80]!r}")
        key, _, rest = rest[start + len("<parameter="):].partition(">")
        value, found, rest = rest.partition("</parameter>")
        if not found:
            raise MalformedToolCall(f"{where}: parameter {key!r} is not closed")
        value = value.removeprefix("\n").removesuffix("\n")
        prop = properties.get(key) if isinstance(properties, dict) else None
        arguments[key.strip()] = _typed(value, prop, f"{where}, parameter {key!r}")
    if rest.strip():
        raise MalformedToolCall(f"{where}: text outside a parameter: {rest.strip()[:80]!r}")
    if not name:
        raise MalformedToolCall(f"{where} has no function name")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _typed(value: str, prop: Any, where: str) -> Any:
    """``value`` as its schema's type: JSON for non-string types, the text otherwise."""
    kind = prop.get("type") if isinstance(prop, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds or not any(k in _JSON_TYPES for k in kinds):
        return value  # a string, or a parameter the schema does not type: the text as written
    try:
        decoded = json.loads(value)
    except json.JSONDecodeError:
        raise MalformedToolCall(f"{where} must be {' or '.join(map(str, kinds))}, got {value[:80]!r}") from None
    return decoded
