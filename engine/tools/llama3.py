"""Llama 3.x JSON tool calls (vLLM's ``llama3_json``): the answer is one JSON object
``{"name": ..., "parameters": {...}}`` (or several, separated by ``;``), optionally
after the ``<|python_tag|>`` token. An answer that does not begin with ``{`` is text."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .calls import MalformedToolCall, ToolCallOutput, ToolChoice, call_from_object
from .markers import decode, single_token_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    """JSON calls making up the whole answer."""

    name = "llama3_json"

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.tag_id = single_token_id(tokenizer, PYTHON_TAG)

    def parse(self, token_ids: list[int], choice: ToolChoice) -> ToolCallOutput:
        at = token_ids.index(self.tag_id) if self.tag_id is not None and self.tag_id in token_ids else None
        tagged = at is not None
        before = ""
        if at is not None:
            before = decode(self.tokenizer, token_ids[:at]).strip()
            token_ids = token_ids[at + 1:]
        text = decode(self.tokenizer, token_ids).strip()
        if not text.startswith("{"):
            if tagged:
                raise MalformedToolCall(f"{PYTHON_TAG} is followed by no JSON call: {text[:120]!r}")
            return ToolCallOutput(text or None)
        try:
            objects = _json_objects(text)
        except MalformedToolCall:
            if tagged or '"name"' in text:
                raise  # broken JSON naming a function: a call the model botched
            return ToolCallOutput(text)  # text that merely begins with a brace
        if not tagged and not (isinstance(objects[0], dict) and "name" in objects[0]):
            return ToolCallOutput(text)  # a JSON answer, not a call
        calls = tuple(call_from_object(value, f"call {number + 1}") for number, value in enumerate(objects))
        return ToolCallOutput((before or None) if tagged else None, calls)


def _json_objects(text: str) -> list[object]:
    """The JSON values of ``text``, separated by ``;`` or whitespace."""
    decoder = json.JSONDecoder()
    values, position = [], 0
    while position < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            raise MalformedToolCall(f"call {len(values) + 1} is not JSON ({exc}): {text[position:][:120]!r}") \
                from None
        values.append(value)
        rest = text[position:].lstrip()
        rest = rest[1:].lstrip() if rest.startswith(";") else rest
        position = len(text) - len(rest)
    return values

