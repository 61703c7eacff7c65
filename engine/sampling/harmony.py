"""gpt-oss's harmony format as a reasoning parser (vLLM's name: ``openai_gptoss``).

A harmony completion is a series of messages, each a header and a body:
``<|start|>assistant<|channel|>analysis<|message|>`` thinking ``<|end|>``, then
``<|start|>assistant<|channel|>final<|message|>`` answer ``<|return|>``. The chat
template's generation prompt ends with ``<|start|>assistant``, so generation begins
inside a header. The bodies of the ``final`` channel are the answer; the bodies of
every other channel (``analysis``, ``commentary``) are reasoning; headers belong to
neither. The channel is read from the header's tokens when ``<|message|>`` ends it.
A message addressed to a recipient (``to=functions.NAME`` in its header) is a tool
call: its body is the call's arguments (engine/tools/harmony.py reads it), neither
reasoning nor answer, so it is not counted among the reasoning tokens.

Invariants (beside those of reasoning.py):
- A sequence is in HEADER from a message's start to its ``<|message|>``, then in
  REASONING or ANSWER for its body (a tool call's body is REASONING whose tokens are
  tags); it never leaves ANSWER.
- When the reasoning budget is spent inside a body, the tokens that end it and open
  the final channel (``<|end|><|start|>assistant<|channel|>final<|message|>``) are
  forced one by one, and the answer begins after them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .reasoning_phase import Phase, ReasoningParserError, TokenRole

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NAME = "openai_gptoss"
_REQUIRED = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>")


@dataclass(frozen=True)
class HarmonyParser:
    """The harmony special tokens of one tokenizer, and the token ids of the channel
    name ``final`` and the role ``assistant`` as they follow a special token."""

    name: str
    start_id: int
    end_id: int
    message_id: int
    channel_id: int
    constrain_id: int | None
    final_ids: tuple[int, ...]
    assistant_ids: tuple[int, ...]
    # The text of a header's tokens (to find a recipient); None reads no recipients.
    decode: Callable[[list[int]], str] | None = field(default=None, compare=False)

    @property
    def final_header(self) -> tuple[int, ...]:
        """What ends a reasoning body and opens the answer."""
        return (self.end_id, self.start_id, *self.assistant_ids, self.channel_id, *self.final_ids, self.message_id)

    def is_final(self, header: list[int]) -> bool:
        """Whether a message header (its tokens up to ``<|message|>``) opens the final channel."""
        if self.channel_id not in header:
            return False
        after = header[len(header) - header[::-1].index(self.channel_id):]
        if self.constrain_id in after:
            after = after[:after.index(self.constrain_id)]
        return tuple(after) == self.final_ids

    def is_call(self, header: list[int]) -> bool:
        """Whether a message header names a recipient (``to=...``): its body is a tool call."""
        return self.decode is not None and any(word.startswith("to=") for word in
                                               self.decode(header).replace("<|", " <|").split())

    def initial_phase(self, prompt_token_ids: list[int]) -> tuple[Phase, list[int]]:
        """The phase generation starts in and, in a header, the header's tokens so far:
        the prompt's last message decides (an open header, or the body it opened)."""
        for position in range(len(prompt_token_ids) - 1, -1, -1):
            token_id = prompt_token_ids[position]
            if token_id == self.message_id:
                start = _last_index(prompt_token_ids, self.start_id, position)
                header = prompt_token_ids[start + 1:position]
                return (Phase.ANSWER if self.is_final(header) else Phase.REASONING), []
            if token_id == self.start_id:
                return Phase.HEADER, list(prompt_token_ids[position + 1:])
            if token_id == self.end_id:
                break
        return Phase.HEADER, []

    def tracker(self, prompt_token_ids: list[int], max_reasoning_tokens: int | None) -> HarmonyTracker:
        return HarmonyTracker(self, prompt_token_ids, max_reasoning_tokens)


def _last_index(token_ids: list[int], token_id: int, before: int) -> int:
    for position in range(before - 1, -1, -1):
        if token_ids[position] == token_id:
            return position
    return -1


def make_harmony_parser(tokenizer: PreTrainedTokenizerBase) -> HarmonyParser:
    """The harmony parser of ``tokenizer``; ReasoningParserError naming the special
    tokens it lacks."""
    vocab = tokenizer.get_vocab()
    missing = [token for token in _REQUIRED if token not in vocab]
    if missing:
        raise ReasoningParserError(f"reasoning_parser {NAME!r} needs the harmony tokens {', '.join(_REQUIRED)}, "
                                   f"but the tokenizer has no {', '.join(missing)}")

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    def decode(token_ids: list[int]) -> str:
        text = tokenizer.decode(token_ids, skip_special_tokens=False)
        assert isinstance(text, str), "one list of ids decodes to one string"
        return text

    return HarmonyParser(NAME, vocab["<|start|>"], vocab["<|end|>"], vocab["<|message|>"], vocab["<|channel|>"],
                         vocab.get("<|constrain|>"), ids("final"), ids("assistant"), decode)


class HarmonyTracker:
    """One sample's place in the harmony format, advanced by each sampled token (the
    same interface as reasoning.ReasoningTracker)."""

    def __init__(self, parser: HarmonyParser, prompt_token_ids: list[int], max_reasoning_tokens: int | None) -> None:
        self.parser = parser
        self.phase, self._header = parser.initial_phase(prompt_token_ids)
        self.max_reasoning_tokens = max_reasoning_tokens
        self.num_reasoning_tokens = 0
        self.reasoned = self.phase is Phase.REASONING
        self._in_call = False  # in a tool call's body: neither reasoning nor answer
        self._forced: list[int] = []  # tokens that must come next, in order
        self._check_budget()

    def feed(self, token_id: int) -> TokenRole:
        """Advance by one sampled token; return what the token is part of."""
        parser = self.parser
        if self._forced and token_id == self._forced[0]:
            self._forced.pop(0)
        if self.phase is Phase.ANSWER:
            return TokenRole.ANSWER
        if self.phase is Phase.HEADER:
            if token_id == parser.message_id:
                self.phase = Phase.ANSWER if parser.is_final(self._header) else Phase.REASONING
                self._in_call = self.phase is Phase.REASONING and parser.is_call(self._header)
                self.reasoned = self.reasoned or (self.phase is Phase.REASONING and not self._in_call)
                self._header = []
                self._check_budget()
            elif token_id == parser.start_id:
                self._header = []
            else:
                self._header.append(token_id)
            return TokenRole.TAG
        if token_id in (parser.end_id, parser.start_id):  # the body ends; the next header begins
            self.phase = Phase.HEADER
            return TokenRole.TAG
        if self._in_call:
            return TokenRole.TAG
        self.num_reasoning_tokens += 1
        self._check_budget()
        return TokenRole.REASONING

    def _check_budget(self) -> None:
        # A tool call's arguments are never cut by the budget (its body counts no tokens).
        if (self.phase is Phase.REASONING and not self._in_call and not self._forced
                and self.max_reasoning_tokens is not None
                and self.num_reasoning_tokens >= self.max_reasoning_tokens):
            self._forced = list(self.parser.final_header)

    @property
    def forced_token_id(self) -> int | None:
        """The token the next sample must be (the budget is spent), or None."""
        return self._forced[0] if self._forced else None
