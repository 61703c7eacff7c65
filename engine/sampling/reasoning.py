"""Reasoning parsers: which generated tokens are a model's thinking and which its answer.

A reasoning model wraps its thinking in tags that are single special tokens
(``<think>`` ... ``</think>`` for Qwen3 and DeepSeek-R1 style models), or writes it
in channels of its own (gpt-oss's harmony format: harmony.py). The split is
decided token by token as tokens are sampled, not by parsing text afterwards,
because the engine needs it while generating: a structured-output constraint
applies only to the answer, and ``max_reasoning_tokens`` forces the end tag.

Invariants:
- A sequence is in one phase at a time: UNDECIDED (only before its first token),
  REASONING, ANSWER or (harmony only) HEADER; it never goes back from ANSWER.
- The tags themselves belong to neither the reasoning nor the answer text.
- ``num_reasoning_tokens`` counts the tokens generated in REASONING, tags excluded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .harmony import HarmonyParser, make_harmony_parser
from .reasoning_phase import Phase, ReasoningParserError, TokenRole

if TYPE_CHECKING:  # the config imports this module; it stays free of transformers
    from transformers import PreTrainedTokenizerBase

__all__ = ["REASONING_PARSERS", "Phase", "ReasoningParser", "ReasoningParserError", "ReasoningTracker", "TokenRole",
           "answer_token_ids", "make_reasoning_parser"]

REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")


@dataclass(frozen=True)
class ReasoningParser:
    """A think-tag parser, chosen once per engine (``EngineConfig.reasoning_parser``).

    ``starts_reasoning``: whether generation that follows a prompt without any think
    tag begins in reasoning. DeepSeek-R1 style models always reason first (their
    chat template may or may not have written ``<think>``); a Qwen3 model chooses,
    by emitting ``<think>`` or not as its first token.
    """

    name: str
    start_token_id: int
    end_token_id: int
    starts_reasoning: bool

    def initial_phase(self, prompt_token_ids: list[int]) -> Phase:
        """The phase generation starts in: the last think tag in the prompt decides
        (a template that disables thinking writes ``<think></think>`` itself)."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self.end_token_id:
                return Phase.ANSWER
            if token_id == self.start_token_id:
                return Phase.REASONING
        return Phase.REASONING if self.starts_reasoning else Phase.UNDECIDED

    def tracker(self, prompt_token_ids: list[int], max_reasoning_tokens: int | None) -> ReasoningTracker:
        """A new sample's tracker."""
        return ReasoningTracker(self, prompt_token_ids, max_reasoning_tokens)


def make_reasoning_parser(name: str, tokenizer: PreTrainedTokenizerBase) -> ReasoningParser | HarmonyParser:
    """The parser ``name`` for ``tokenizer``; ReasoningParserError if the name is
    unknown or the tokenizer lacks its special tokens (single-token ``<think>`` and
    ``</think>``, or harmony's)."""
    if name not in REASONING_PARSERS:
        raise ReasoningParserError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; got {name!r}")
    if name == "openai_gptoss":
        return make_harmony_parser(tokenizer)
    vocab = tokenizer.get_vocab()
    missing = [tag for tag in ("<think>", "</think>") if tag not in vocab]
    if missing:
        raise ReasoningParserError(f"reasoning_parser {name!r} needs the tokens <think> and </think>, but the "
                                   f"tokenizer has no {' or '.join(missing)}")
    return ReasoningParser(name, vocab["<think>"], vocab["</think>"], starts_reasoning=name == "deepseek_r1")


class ReasoningTracker:
    """One sample's phase, advanced by each sampled token."""

    def __init__(self, parser: ReasoningParser, prompt_token_ids: list[int], max_reasoning_tokens: int | None) -> None:
        self.parser = parser
        self.phase = parser.initial_phase(prompt_token_ids)
        self.max_reasoning_tokens = max_reasoning_tokens
        self.num_reasoning_tokens = 0
        # Whether the sample was ever in REASONING (its output then has a reasoning part).
        self.reasoned = self.phase is Phase.REASONING
        self._at_reasoning_start = self.reasoned

    def feed(self, token_id: int) -> TokenRole:
        """Advance by one sampled token; return what the token is part of."""
        parser = self.parser
        if self.phase == Phase.UNDECIDED:
            if token_id == parser.start_token_id:
                self.phase = Phase.REASONING
                self.reasoned = True
                return TokenRole.TAG
            self.phase = Phase.ANSWER
            return TokenRole.ANSWER
        if self.phase == Phase.REASONING:
            at_start, self._at_reasoning_start = self._at_reasoning_start, False
            if token_id == parser.end_token_id:
                self.phase = Phase.ANSWER
                return TokenRole.TAG
            if at_start and token_id == parser.start_token_id:
                return TokenRole.TAG  # the model opened the tag its template did not write
            self.num_reasoning_tokens += 1
            return TokenRole.REASONING
        return TokenRole.ANSWER

    @property
    def forced_token_id(self) -> int | None:
        """The token the next sample must be (the end tag, once the budget is spent), or None."""
        return self.parser.end_token_id if self.must_end_reasoning else None

    @property
    def must_end_reasoning(self) -> bool:
        """The reasoning budget is spent: the next token must be the end tag."""
        return (self.phase == Phase.REASONING and self.max_reasoning_tokens is not None
                and self.num_reasoning_tokens >= self.max_reasoning_tokens)


def answer_token_ids(parser: ReasoningParser | HarmonyParser, prompt_token_ids: list[int],
                     output_token_ids: list[int]) -> list[int]:
    """The generated tokens ``parser`` puts in the answer, as a tracker classified them
    while they were sampled (a budget only forces which tokens come, not their roles)."""
    tracker = parser.tracker(prompt_token_ids, None)
    return [token_id for token_id in output_token_ids if tracker.feed(token_id) is TokenRole.ANSWER]
