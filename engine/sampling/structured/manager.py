"""The engine's structured-output component (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from ...params import StructuredOutputsParams
from .bitmask import allows_only, step_bitmask
from .grammar import GrammarCompiler, GrammarState, StructuredOutputError

if TYPE_CHECKING:  # the sequence records import this package
    from ..sequences import RequestState, SequenceRecord


class StructuredOutputManager:
    """The engine's structured-output component: compiles each request's constraint,
    holds back sequences whose grammar is still compiling, gives each sample its
    matcher, and builds each step's bitmask.

    A sequence that reaches its first sampling before its grammar has compiled is
    held: the logits of its next position are kept (a copy: the runner may reuse its
    buffers) and it computes nothing more, keeping its KV, while the rest of the
    batch runs; it samples from those logits in the first step after the grammar
    compiles. Preempted meanwhile, it recomputes the same position, whose new logits
    replace the kept ones.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._held_logits: dict[str, torch.Tensor] = {}

    def submit(self, request_id: str, params: StructuredOutputsParams | None) -> Future | None:
        """The future compiled grammar of a request's constraint (None without one);
        StructuredOutputError naming the request if it cannot compile."""
        return None if params is None else self.compiler.submit(request_id, params)

    def has_held(self) -> bool:
        return bool(self._held_logits)

    def forget(self, sequence_id: str) -> None:
        self._held_logits.pop(sequence_id, None)

    def hold(self, rows: list[SequenceRecord], logits: torch.Tensor | None, state_of: Callable[[str], RequestState],
             failures: dict[str, StructuredOutputError]) -> tuple[list[SequenceRecord], torch.Tensor | None]:
        """The rows that may sample now, and their logits; the others are held."""
        if not rows:
            return rows, logits
        assert logits is not None, "rows to sample come with their logits"
        keep = []
        for i, row in enumerate(rows):
            sequence_id = row.sequence.request_id
            self._held_logits.pop(sequence_id, None)  # recomputed after a preemption: these are newer
            state = state_of(sequence_id)
            if self.ready(state, failures):
                keep.append(i)
            elif state.request_id not in failures:
                self._held_logits[sequence_id] = logits[i].clone()
        if len(keep) == len(rows):
            return rows, logits
        kept_logits = logits.index_select(0, torch.tensor(keep, device=logits.device)) if keep else None
        return [rows[i] for i in keep], kept_logits

    def release(self, rows: list[SequenceRecord], logits: torch.Tensor | None, state_of: Callable[[str], RequestState],
                row_of: Callable[[str], SequenceRecord], failures: dict[str, StructuredOutputError],
                wait_first: bool = False) -> tuple[list[SequenceRecord], torch.Tensor | None]:
        """``rows`` plus the held sequences whose grammar has compiled, with their
        logits appended. ``wait_first`` (when the engine has nothing else to compute):
        first wait until one of their grammars is ready."""
        if not self._held_logits:
            return rows, logits
        if wait_first:
            compiling = {future for s in self._held_logits if (future := state_of(s).grammar) is not None}
            wait(compiling, return_when=FIRST_COMPLETED)
        released, released_logits = [], []
        for sequence_id in list(self._held_logits):
            state = state_of(sequence_id)
            if self.ready(state, failures):
                released.append(row_of(sequence_id))
                released_logits.append(self._held_logits.pop(sequence_id))
            elif state.request_id in failures:
                self._held_logits.pop(sequence_id)
        if not released:
            return rows, logits
        held = torch.stack(released_logits)
        return rows + released, held if logits is None else torch.cat([logits, held.to(logits.dtype)])

    def ready(self, state: RequestState, failures: dict[str, StructuredOutputError]) -> bool:
        """Whether the request may sample: it has no constraint or its grammar has
        compiled (its samples then get their matchers). A failed compilation is put
        in ``failures``."""
        future = state.grammar
        if future is None:
            return True
        if state.request_id in failures or not future.done():
            return False
        if future.exception() is not None:
            failures[state.request_id] = StructuredOutputError(
                f"request {state.request_id!r}: its grammar failed to compile: {future.exception()}")
            return False
        # A grammar ends with a stop token; under ignore_eos without stop tokens, EOS.
        stop_ids = sorted(state.params.all_stop_token_ids or self.eos_token_ids)
        constraint = state.params.structured_outputs
        assert constraint is not None, f"request {state.request_id!r} compiled a grammar without a constraint"
        for sample in state.samples:
            sample.grammar = GrammarState(future.result(), stop_ids, constraint.kind)
        state.grammar = None
        return True

    def bitmask(self, rows: list[SequenceRecord],
                samples: list[SequenceRecord]) -> tuple[torch.Tensor | None, set[int]]:
        """The step's bitmask (see ``step_bitmask``) and the restricted rows whose
        pick must be checked against it: those with another sampling constraint
        (allowed_token_ids, logit_bias, bad words, min_tokens, penalties) that may
        leave none of the tokens the bitmask allows. Any other restricted row picks
        an allowed token, its allowed logits being the model's and all others -inf
        (a pick its grammar rejects all the same fails at its matcher, naming the
        request). min_tokens yields where a grammar allows nothing but ending: the
        output must parse."""
        bitmask, restricted = step_bitmask(self.compiler, [s.grammar for s in samples],
                                           [s.reasoning for s in samples], self.vocab_size)
        if bitmask is None:  # no row is restricted
            return bitmask, restricted
        to_check = set()
        for i in restricted:
            row = rows[i]
            blocked = row.blocked_token_ids
            if blocked and samples[i].grammar is not None and allows_only(bitmask, i, set(blocked)):
                row.blocked_token_ids = ()
            if row.blocked_token_ids or row.banned_token_ids or row.traits.has_logit_processors:
                to_check.add(i)
        return bitmask, to_check

    def close(self) -> None:
        self.compiler.close()

