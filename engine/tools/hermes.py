"""Hermes / Qwen tool calls (vLLM's ``hermes``): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``,
any number of them, with the model's text around them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .calls import MalformedToolCall, ToolCall, ToolCallOutput, ToolChoice, content_or_none, json_call
from .markers import Marked, decode, single_token_id, split_ids, split_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser:
    """``<tool_call>`` JSON calls, read on the marker tokens when the tokenizer has them."""

    name = "hermes"

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.open_id, self.close_id = single_token_id(tokenizer, OPEN), single_token_id(tokenizer, CLOSE)

    def parse(self, token_ids: list[int], choice: ToolChoice) -> ToolCallOutput:
        if self.open_id is not None and self.close_id is not None:
            marked = split_ids(token_ids, self.open_id, self.close_id)
            texts = Marked([decode(self.tokenizer, part) for part in marked.outside],
                           [decode(self.tokenizer, body) for body in marked.bodies],
                           marked.closed)
        else:
            texts = split_text(decode(self.tokenizer, token_ids), OPEN, CLOSE)
        return read_marked_json(texts, "<tool_call>")


def read_marked_json(marked: Marked[str], marker: str) -> ToolCallOutput:
    """Calls whose bodies are JSON objects; a last call left open counts when its JSON is
    whole (a model may end its turn without the closing marker)."""
    calls: list[ToolCall] = []
    for number, (body, closed) in enumerate(zip(marked.bodies, marked.closed)):
        where = f"{marker} call {number + 1}"
        try:
            calls.append(json_call(body, where))
        except MalformedToolCall as exc:
            if not closed:
                raise MalformedToolCall(f"{where} is not closed and its JSON is cut off: {body.strip()[:120]!r}") \
                    from None
            raise exc from None
    return ToolCallOutput(content_or_none("".join(marked.outside)), tuple(calls))
