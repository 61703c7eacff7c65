"""Splitting an answer at the markers that open and close tool calls: on token ids when
the markers are single tokens (a model writing the marker's text in ordinary tokens
does not open a call), on the decoded text when the tokenizer has no such tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Part = TypeVar("Part", str, list[int])


@dataclass(frozen=True)
class Marked(Generic[Part]):
    """An answer cut at its markers: what lies outside every call, and each call's body
    (``closed`` False for a last call the answer never closed)."""

    outside: list[Part]
    bodies: list[Part]
    closed: list[bool]


def split_ids(token_ids: list[int], open_id: int, close_id: int | None) -> Marked[list[int]]:
    """Cut ``token_ids`` at the tokens ``open_id`` ... ``close_id`` (None: a call runs to
    the next ``open_id`` or the end)."""
    outside: list[list[int]] = [[]]
    bodies: list[list[int]] = []
    closed: list[bool] = []
    inside = False
    for token_id in token_ids:
        if token_id == open_id:
            if inside:
                closed[-1] = close_id is None
            bodies.append([])
            closed.append(False)
            inside = True
        elif inside and token_id == close_id:
            closed[-1], inside = True, False
            outside.append([])
        elif inside:
            bodies[-1].append(token_id)
        else:
            outside[-1].append(token_id)
    if inside and close_id is None and bodies:
        closed[-1] = True
    return Marked(outside, bodies, closed)


def split_text(text: str, open_text: str, close_text: str) -> Marked[str]:
    """Cut ``text`` at the strings ``open_text`` ... ``close_text``."""
    outside, bodies, closed = [], [], []
    position = 0
    while (start := text.find(open_text, position)) >= 0:
        outside.append(text[position:start])
        end = text.find(close_text, start + len(open_text))
        if end < 0:
            bodies.append(text[start + len(open_text):])
            closed.append(False)
            return Marked(outside, bodies, closed)
        bodies.append(text[start + len(open_text):end])
        closed.append(True)
        position = end + len(close_text)
    outside.append(text[position:])
    return Marked(outside, bodies, closed)


def single_token_id(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    """The id of ``text`` when the tokenizer has it as one (added) token, else None."""
    token_id = tokenizer.get_vocab().get(text)
    return token_id if isinstance(token_id, int) else None


def decode(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of ``token_ids`` (content drops special tokens such as the end of turn)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str), "one list of ids decodes to one string"
    return text
