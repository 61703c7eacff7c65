"""gpt-oss tool calls in the harmony format (vLLM's ``openai``).

A completion is a series of messages, each a header and a body. A message whose
header names a recipient ``to=functions.NAME`` is a call of NAME, its body the
arguments (``<|constrain|>json`` may say so), ended by ``<|call|>``; the ``final``
channel's bodies are the content; other channels (``analysis``) are reasoning and
belong to neither. Generation starts inside the first header (the generation prompt
ends with ``<|start|>assistant``). Headers are read whole, after their ``<|message|>``
token, so no marker is searched for in text the model is still writing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .calls import MalformedToolCall, ToolCall, ToolCallOutput, ToolChoice, ToolParserError, arguments_text
from .markers import decode, single_token_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>")


@dataclass(frozen=True)
class HarmonyMessage:
    """One message of a completion: its header's channel and recipient, its body, and
    whether the body was ended by a token (not cut by the length limit)."""

    channel: str | None
    recipient: str | None
    body: list[int]
    ended: bool


class HarmonyToolParser:
    """Function calls and final-channel content of a harmony completion."""

    name = "openai"

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        ids = {text: single_token_id(tokenizer, text) for text in _TOKENS}
        missing = [text for text, token_id in ids.items() if token_id is None]
        if missing:
            raise ToolParserError(f"tool_call_parser 'openai' needs the harmony tokens {', '.join(_TOKENS)}; this "
                                  f"tokenizer lacks {', '.join(missing)}")
        self.tokenizer = tokenizer
        self.start, self.end, self.message, self.channel, self.call, self.return_ = (ids[text] for text in _TOKENS)

    def messages(self, token_ids: list[int]) -> list[HarmonyMessage]:
        """The completion's messages (one still in its header is left out)."""
        found: list[HarmonyMessage] = []
        header: list[int] = []
        body: list[int] | None = None
        for token_id in token_ids:
            if body is None:
                if token_id == self.message:
                    body = []
                elif token_id == self.start:
                    header = []
                else:
                    header.append(token_id)
            elif token_id in (self.end, self.call, self.return_, self.start):
                found.append(self._message(header, body, ended=True))
                header, body = [], None
            else:
                body.append(token_id)
        if body is not None:
            found.append(self._message(header, body, ended=False))
        return found

    def _message(self, header: list[int], body: list[int], ended: bool) -> HarmonyMessage:
        # "<|channel|>commentary to=functions.f <|constrain|>json" (the recipient may also
        # come before the channel): words split at spaces and before each special token.
        words = decode(self.tokenizer, header, skip_special_tokens=False).replace("<|", " <|").split()
        channel = next((word.removeprefix("<|channel|>") for word in words if word.startswith("<|channel|>")), None)
        recipient = next((word.removeprefix("to=") for word in words if word.startswith("to=")), None)
        return HarmonyMessage(channel, recipient, body, ended)

    def parse(self, token_ids: list[int], choice: ToolChoice) -> ToolCallOutput:
        calls: list[ToolCall] = []
        content: list[str] = []
        for message in self.messages(token_ids):
            if message.recipient is not None and message.recipient.startswith("functions."):
                where = f"call {len(calls) + 1} (to={message.recipient})"
                arguments = decode(self.tokenizer, message.body).strip()
                try:
                    calls.append(ToolCall(message.recipient.removeprefix("functions."),
                                          arguments_text(arguments or "{}", where)))
                except MalformedToolCall:
                    if not message.ended:
                        raise MalformedToolCall(f"{where} is not ended and its arguments are cut off") from None
                    raise
            elif message.channel == "final":
                content.append(decode(self.tokenizer, message.body))
        text = "".join(content).strip()
        return ToolCallOutput(text or None, tuple(calls))
