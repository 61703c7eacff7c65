"""The vocabulary every reasoning parser shares (reasoning.py's think tags, harmony.py's
channels): the phase a sequence is in, what a sampled token is part of, and the error
a parser this tokenizer or request cannot use raises. It imports nothing, so both
parsers' modules build on it and reasoning.py can offer harmony's parser."""

from __future__ import annotations

import enum


class ReasoningParserError(ValueError):
    """A reasoning parser that this tokenizer or request cannot use."""


class Phase(enum.Enum):
    UNDECIDED = "undecided"  # Qwen3 with no tag in the prompt: the first token decides
    REASONING = "reasoning"
    ANSWER = "answer"
    HEADER = "header"  # harmony: inside a message header, neither reasoning nor answer


class TokenRole(enum.Enum):
    REASONING = "reasoning"
    ANSWER = "answer"
    TAG = "tag"
