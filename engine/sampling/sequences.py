"""The engine's requests and their sequences: one record per sequence, owned by one
table.

A request with n > 1 is one RequestState over n sequences (its samples). Each
sequence has one SequenceRecord, made when the request is added and dropped when it
finishes or is aborted, holding everything the sampler and the output processor
read of it: its scheduler Request, its owner, its sample index, its generator, its
sample row (logits row, per-token bans) and its request's SamplingTraits. Rows of a
step are the records themselves, so appending a sampled token reads no map.

Invariants:
- ``Sequences`` holds a record exactly for each sequence of each request it holds;
  removing a request removes its records, forgets any logits held for them and drops
  the steady-step cache (a sequence id may then be taken by another request).
- A record's ``steady`` is set at its first sampling and only where its traits have
  a steady row: from then on nothing but ``logits_row`` changes from step to step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..core.request import Request
from ..core.scheduler import ScheduledRequest
from ..outputs import Logprob, RequestMetrics
from ..params import SamplingParams, SamplingTraits
from .detokenizer import IncrementalDetokenizer
from .harmony import HarmonyTracker
from .reasoning import ReasoningTracker
from .structured import GrammarState


@dataclass(slots=True)
class SequenceRecord:
    """One of a request's n sample sequences, as the sampler and the output processor
    see it. Slotted, as are RequestState and Request: each step reads a few fields of
    every sampled sequence, so they sit in the objects themselves (fewer cache lines to
    fetch after a forward); the fields the common paths read come first."""

    sequence: Request
    index: int
    # The request it is a sample of, its params and their traits.
    owner: RequestState = field(repr=False, compare=False)
    params: SamplingParams = field(repr=False, compare=False)
    traits: SamplingTraits
    detokenizer: IncrementalDetokenizer | None
    # Its text is made when its request finishes (traits.text_at_finish; cleared
    # once made, so a second output reads it as it is).
    text_at_finish: bool = False
    # The params' all_stop_token_ids: stop_token_ids, and EOS unless ignore_eos.
    stop_token_ids: set[int] = field(default_factory=set)
    # The params' own stop strings and stop_token_ids (SamplingParams.stop_lists).
    stop_strings: list[str] = field(default_factory=list)
    requested_stop_token_ids: list[int] = field(default_factory=list)
    # The output length that ends it: max_tokens, or what max_model_len leaves.
    max_output_tokens: int = 0
    # Sample row: the step's logits row it samples from, and whether nothing else
    # changes from step to step (see the module's invariants).
    logits_row: int = 0
    steady: bool = False
    # Its own generator when the request is seeded (its draws then do not depend on
    # the batch), else None.
    generator: torch.Generator | None = None
    # Stop token ids that must not be sampled yet (min_tokens), or empty.
    blocked_token_ids: tuple[int, ...] = ()
    # Token ids to ban at this position (bad words), or empty.
    banned_token_ids: tuple[int, ...] = ()
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None
    # The structured-output matcher (set once the request's grammar is compiled).
    grammar: GrammarState | None = None
    # With a reasoning parser: the phase, and the reasoning tokens' own text.
    reasoning: ReasoningTracker | HarmonyTracker | None = None
    reasoning_detokenizer: IncrementalDetokenizer | None = None
    reasoning_text: str = ""


@dataclass(slots=True)
class RequestState:
    """A user request as the engine tracks it until its output is returned."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    traits: SamplingTraits
    lora_request: object | None
    metrics: RequestMetrics
    samples: list[SequenceRecord] = field(default_factory=list)
    # Samples 1..n-1 until they fork from sample 0 after its prompt is computed.
    pending_forks: list[Request] = field(default_factory=list)
    # Token sequences that must not be generated (SamplingParams.bad_words).
    bad_words_ids: list[list[int]] = field(default_factory=list)
    # One entry per prompt token once computed (None for the first token).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # The structured-output grammar while it compiles (None once its samples have
    # their matchers, and for requests without a constraint).
    grammar: Future | None = None

    @property
    def finished(self) -> bool:
        return all(s.sequence.is_finished for s in self.samples)


@dataclass
class SteadyStep:
    """The rows of a step in which every scheduled sequence sampled, with a steady
    row, and may leave its token pending. A later step that samples the same
    sequences from the same logits rows (``sample_rows``, sequence id -> row) samples
    with these rows as they are."""

    sample_rows: dict[str, int]
    rows: list[SequenceRecord]


class Sequences:
    """The engine's unfinished requests and one SequenceRecord per sequence: adds a
    request's sequences, makes each step's sample rows (forking the n > 1 samples at
    their first sampling), and removes a request's records when it finishes or is
    aborted.

    ``new_record`` makes a sequence's record (the output processor's, which knows
    the tokenizer); ``copy_forked`` gives forked children their parent's KV blocks
    and recurrent state; ``forget_held`` drops logits held for a sequence's grammar.
    """

    def __init__(self, new_record: Callable[[RequestState, Request, int], SequenceRecord],
                 copy_forked: Callable[[Request, list[Request]], None],
                 forget_held: Callable[[str], None]) -> None:
        self._new_record = new_record
        self._copy_forked = copy_forked
        self._forget_held = forget_held
        self._requests: dict[str, RequestState] = {}
        self._records: dict[str, SequenceRecord] = {}  # by sequence id
        self._steady: SteadyStep | None = None  # see sample_rows

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def add(self, state: RequestState, sequences: list[Request]) -> None:
        """Hold ``state`` and one record per sequence (sample ``i`` is ``sequences[i]``).
        The caller schedules ``sequences[0]``; the others fork from it once its prompt
        is computed, so the prompt is computed once and its KV blocks are shared."""
        state.pending_forks = sequences[1:]
        seed = state.params.seed
        for index, sequence in enumerate(sequences):
            record = self._new_record(state, sequence, index)
            if seed is not None:
                record.generator = torch.Generator().manual_seed(seed + index)
            state.samples.append(record)
            self._records[sequence.request_id] = record
        self._requests[state.request_id] = state

    def remove(self, request_id: str) -> RequestState | None:
        """Drop a request and its records (None if it is not held)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        for record in state.samples:
            sequence_id = record.sequence.request_id
            self._records.pop(sequence_id, None)
            self._forget_held(sequence_id)
        self._steady = None
        return state

    def state_of(self, sequence_id: str) -> RequestState:
        return self._records[sequence_id].owner

    def held_row(self, sequence_id: str) -> SequenceRecord:
        """The row of a sequence held for its grammar (its logits come separately)."""
        return self._prepare_row(self._records[sequence_id], 0)

    def sample_rows(self, scheduled: list[ScheduledRequest],
                    sample_rows: dict[str, int]) -> tuple[list[SequenceRecord], bool]:
        """One row per sequence that samples this step (``sample_rows``: sequence id ->
        logits row; forked samples join their parent's first sampling, on the same
        logits row), and whether every one of them may leave its token pending (async
        scheduling)."""
        steady = self._steady
        if steady is not None and len(sample_rows) == len(scheduled) and sample_rows == steady.sample_rows:
            return list(steady.rows), True
        rows: list[SequenceRecord] = []
        deferrable = reusable = True
        records = self._records
        for item in scheduled:
            record = records[item.request.request_id]
            logits_row = sample_rows.get(item.request.request_id)
            if record.steady:
                # Sampled before (so scheduled before), nothing to recompute, forked.
                if logits_row is not None:
                    record.logits_row = logits_row
                    rows.append(record)
                    deferrable = deferrable and record.traits.pipelinable
                continue
            state = record.owner
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = time.monotonic()
            if logits_row is None:
                continue
            rows.append(self._prepare_row(record, logits_row))
            reusable = reusable and record.steady
            if state.pending_forks:
                deferrable = False
                rows += [self._prepare_row(child, logits_row) for child in self._fork(record)]
            elif not state.traits.pipelinable:
                deferrable = False
        reusable = reusable and deferrable and len(rows) == len(sample_rows) == len(scheduled)
        self._steady = SteadyStep(sample_rows, list(rows)) if reusable else None
        return rows, deferrable

    def _prepare_row(self, record: SequenceRecord, logits_row: int) -> SequenceRecord:
        """Point the record at its logits row and recompute what changes from token to
        token (min_tokens, bad words)."""
        record.steady = record.traits.steady_row
        record.logits_row = logits_row
        params = record.params
        if params.min_tokens:
            num_output = record.sequence.num_output_tokens
            record.blocked_token_ids = tuple(params.all_stop_token_ids) if num_output < params.min_tokens else ()
        bad_words_ids = record.owner.bad_words_ids
        if bad_words_ids:
            record.banned_token_ids = bad_word_bans(record.sequence.output_token_ids, bad_words_ids)
        return record

    def _fork(self, parent: SequenceRecord) -> list[SequenceRecord]:
        state = parent.owner
        children, state.pending_forks = state.pending_forks, []
        self._copy_forked(parent.sequence, children)
        return [self._records[child.request_id] for child in children]


def bad_word_bans(output_token_ids: list[int], bad_words_ids: list[list[int]]) -> tuple[int, ...]:
    """Token ids that would complete a bad word right now: the last token of each
    bad word whose other tokens end the output so far (single-token words always)."""
    banned = []
    for word in bad_words_ids:
        prefix = word[:-1]
        if not prefix or output_token_ids[-len(prefix):] == prefix:
            banned.append(word[-1])
    return tuple(banned)
