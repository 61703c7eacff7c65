"""Structured outputs: grammars compiled by xgrammar, one matcher per sample, and
one token bitmask per step for the whole batch.

grammar.py parses and compiles constraints; bitmask.py builds and applies a step's
bitmask; manager.py is the engine's component that ties them to requests.

A request's constraint (StructuredOutputsParams) is parsed into an xgrammar Grammar
when the request is added, so a schema, regex or grammar that cannot compile is a
ValueError naming the request before anything is queued. Compiling it against the
tokenizer (the expensive part: a token mask cache over the vocabulary) runs on a
background thread, once per distinct constraint per engine: a million rows sharing
one schema compile it once. A request whose grammar is still compiling is scheduled
as usual (its prompt is computed meanwhile) but held at its first sampling, computing
nothing more until the grammar is ready, while the other requests run.

Invariants:
- A sample's matcher has accepted exactly the sample's answer tokens (the output
  tokens after any reasoning), in order. Preemption recomputes the KV of tokens that
  were already sampled and accepted, never re-samples them, so it leaves the matcher
  as it is; a failed forward samples nothing, so it accepts nothing.
- A row that nothing restricts has an all-ones bitmask row, so applying the batch's
  bitmask leaves its logits bit for bit as they were: constrained and unconstrained
  rows of one batch do not affect each other.
"""

from .bitmask import (
    allow_only,
    allow_token,
    allows_only,
    apply_token_bitmask,
    apply_token_bitmask_reference,
    forbidden_picks,
    new_bitmask,
    step_bitmask,
)
from .grammar import GrammarCompiler, GrammarKey, GrammarState, StructuredOutputError, grammar_key, parse_grammar
from .manager import StructuredOutputManager

__all__ = [
    "GrammarCompiler", "GrammarKey", "GrammarState", "StructuredOutputError", "StructuredOutputManager",
    "allow_only", "allow_token", "allows_only", "apply_token_bitmask", "apply_token_bitmask_reference",
    "forbidden_picks", "grammar_key", "new_bitmask", "parse_grammar", "step_bitmask",
]
