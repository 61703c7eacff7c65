"""Mistral tool calls (vLLM's ``mistral``), after the ``[TOOL_CALLS]`` token, in either
of the layouts Mistral's tokenizers use: a JSON list of ``{"name", "arguments"}``
objects (tokenizer v3 to v7), or ``name[ARGS]{...}`` per call, each after its own
``[TOOL_CALLS]`` (v11 on; ``[CALL_ID]id`` may sit before ``[ARGS]``). The text before
the first ``[TOOL_CALLS]`` is the content."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .calls import (
    MalformedToolCall,
    ToolCall,
    ToolCallOutput,
    ToolChoice,
    ToolParserError,
    arguments_text,
    call_from_object,
    content_or_none,
)
from .markers import decode, single_token_id, split_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralParser:
    """Calls after ``[TOOL_CALLS]``, read on the special tokens."""

    name = "mistral"

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        tool_calls_id = single_token_id(tokenizer, TOOL_CALLS)
        if tool_calls_id is None:
            raise ToolParserError(f"tool_call_parser 'mistral' needs the token {TOOL_CALLS}, which this tokenizer "
                                  "lacks")
        self.tokenizer, self.tool_calls_id = tokenizer, tool_calls_id
        self.args_id, self.call_id_id = single_token_id(tokenizer, ARGS), single_token_id(tokenizer, CALL_ID)

    def parse(self, token_ids: list[int], choice: ToolChoice) -> ToolCallOutput:
        if self.tool_calls_id not in token_ids:
            return ToolCallOutput(content_or_none(decode(self.tokenizer, token_ids)))
        first = token_ids.index(self.tool_calls_id)
        content = content_or_none(decode(self.tokenizer, token_ids[:first]))
        bodies = split_ids(token_ids[first:], self.tool_calls_id, None).bodies
        calls: list[ToolCall] = []
        for number, body in enumerate(bodies):
            where = f"{TOOL_CALLS} call {number + 1}"
            if self.args_id is not None and self.args_id in body:
                calls.append(self._named_call(body, where))
            else:
                calls.extend(self._json_calls(body, where))
        return ToolCallOutput(content, tuple(calls))

    def _named_call(self, body: list[int], where: str) -> ToolCall:
        """``name[ARGS]{...}`` (``[CALL_ID]id`` may come between the name and ``[ARGS]``)."""
        assert self.args_id is not None, "called only when the body holds [ARGS]"
        at = body.index(self.args_id)
        head = body[:at]
        if self.call_id_id is not None and self.call_id_id in head:
            head = head[:head.index(self.call_id_id)]
        name = decode(self.tokenizer, head).strip()
        if not name:
            raise MalformedToolCall(f"{where} has no function name before {ARGS}")
        arguments = decode(self.tokenizer, body[at + 1:]).strip()
        return ToolCall(name, arguments_text(arguments, where))

    def _json_calls(self, body: list[int], where: str) -> list[ToolCall]:
        text = decode(self.tokenizer, body).strip()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MalformedToolCall(f"{where} is not JSON ({exc}): {text[:120]!r}") from None
        values = value if isinstance(value, list) else [value]
        if not values:
            raise MalformedToolCall(f"{where} is an empty list")
        return [call_from_object(item, f"{where}, entry {index + 1}") for index, item in enumerate(values)]
