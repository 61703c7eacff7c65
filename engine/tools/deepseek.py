"""DeepSeek tool calls (vLLM's ``deepseek_v3`` and ``deepseek_v31``), between the
special tokens ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each call between
``<｜tool▁call▁begin｜>`` and ``<｜tool▁call▁end｜>``. V3 writes
``function<｜tool▁sep｜>NAME`` then the arguments in a json code fence; V3.1 writes
``NAME<｜tool▁sep｜>{...}``. One parser reads both. Text outside the calls is the content."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .calls import (
    MalformedToolCall,
    ToolCall,
    ToolCallOutput,
    ToolChoice,
    ToolParserError,
    arguments_text,
    content_or_none,
)
from .markers import decode, single_token_id, split_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class DeepSeekParser:
    """Calls read on DeepSeek's tool-call tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, name: str = "deepseek_v3") -> None:
        ids = {text: single_token_id(tokenizer, text) for text in (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)}
        missing = [text for text, token_id in ids.items() if token_id is None]
        if missing:
            raise ToolParserError(f"tool_call_parser {name!r} needs DeepSeek's tool-call tokens; this tokenizer "
                                  f"lacks {', '.join(missing)}")
        self.name, self.tokenizer = name, tokenizer
        self.calls_begin, self.calls_end, self.call_begin, self.call_end, self.sep = (
            ids[CALLS_BEGIN], ids[CALLS_END], ids[CALL_BEGIN], ids[CALL_END], ids[SEP])

    def parse(self, token_ids: list[int], choice: ToolChoice) -> ToolCallOutput:
        assert self.calls_begin is not None and self.call_begin is not None, "checked when built"
        section = split_ids(token_ids, self.calls_begin, self.calls_end)
        content = content_or_none("".join(decode(self.tokenizer, part) for part in section.outside))
        if not section.bodies:
            return ToolCallOutput(content)
        if len(section.bodies) > 1:
            raise MalformedToolCall(f"{CALLS_BEGIN} appears {len(section.bodies)} times")
        calls = split_ids(section.bodies[0], self.call_begin, self.call_end)
        if not calls.bodies:
            raise MalformedToolCall(f"{CALLS_BEGIN} holds no {CALL_BEGIN}")
        parsed = []
        for number, (body, closed) in enumerate(zip(calls.bodies, calls.closed)):
            parsed.append(self._call(body, closed, f"{CALL_BEGIN} call {number + 1}"))
        return ToolCallOutput(content, tuple(parsed))

    def _call(self, body: list[int], closed: bool, where: str) -> ToolCall:
        if self.sep not in body:
            raise MalformedToolCall(f"{where} has no {SEP}")
        at = body.index(self.sep)
        head, rest = decode(self.tokenizer, body[:at]).strip(), decode(self.tokenizer, body[at + 1:])
        if head == "function":  # V3: NAME, a newline, then ```json ... ```
            name, _, rest = rest.partition("\n")
            rest = rest.strip()
            rest = rest.removeprefix("```json").removeprefix("```").removesuffix("```")
            head = name.strip()
        if not head:
            raise MalformedToolCall(f"{where} has no function name")
        try:
            return ToolCall(head, arguments_text(rest.strip(), where))
        except MalformedToolCall:
            if not closed:
                raise MalformedToolCall(f"{where} is not closed and its arguments are cut off") from None
            raise
