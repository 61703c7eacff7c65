"""Structured outputs: grammars compiled by xgrammar, one matcher per sample, and
one token bitmask per step for the whole batch.

A request's constraint (StructuredOutputsParams) is parsed into an xgrammar Grammar
when the request is added, so a schema, regex or grammar that cannot compile is a
ValueError naming the request before anything is queued. Compiling it against the
tokenizer (the expensive part: a token mask cache over the vocabulary) runs on a
background thread, once per distinct constraint per engine: a million rows sharing
one schema compile it once. The engine holds a request back from the scheduler until
its grammar is compiled; the other requests run meanwhile.

Invariants:
- A sample's matcher has accepted exactly the sample's answer tokens (the output
  tokens after any reasoning), in order. Preemption recomputes the KV of tokens that
  were already sampled and accepted, never re-samples them, so it leaves the matcher
  as it is; a failed forward samples nothing, so it accepts nothing.
- A row that nothing restricts has an all-ones bitmask row, so applying the batch's
  bitmask leaves its logits bit for bit as they were: constrained and unconstrained
  rows of one batch do not affect each other.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from .params import StructuredOutputsParams
from .reasoning import Phase, ReasoningTracker

if TYPE_CHECKING:  # output_processor imports this module
    from .output_processor import RequestState, SampleState
    from .sampler import SampleRow

# Distinct constraints whose parsed and compiled grammars an engine keeps (least
# recently used dropped first); a job usually has one.
MAX_CACHED_GRAMMARS = 256
# Threads xgrammar uses to compile one grammar and to fill a batch's bitmask.
_XGRAMMAR_THREADS = 2
# xgrammar's errors start with "[time] file.cc:line: "; the rest is the reason.
_XGRAMMAR_ERROR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
# The character classes xgrammar (0.2.9) writes for an unescaped character of a JSON
# string: the one of length-bounded strings admits raw control characters (its issue
# 800), and all admit UTF-8-encoded surrogates (U+D800-U+DFFF); JSON parsers reject
# both. The grammar's EBNF text gets JSON's own class instead.
_XGRAMMAR_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]', r'[^\"\\\0-\x1f]')
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


class StructuredOutputError(ValueError):
    """A structured-output constraint that cannot be compiled or satisfied."""


@dataclass(frozen=True)
class GrammarKey:
    """What identifies a compiled grammar: the constraint's kind, its canonical text
    and the options that change the grammar."""

    kind: str
    spec: str
    any_whitespace: bool = True


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """The cache key of ``params``; a JSON schema given as a dict or as text gives the
    same key (property order kept: it is the order the output follows)."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
        spec = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    elif kind == "choice":
        spec = json.dumps(params.choice, ensure_ascii=False)
    elif kind == "json_object":
        spec = ""
    else:
        spec = getattr(params, kind)
    return GrammarKey(kind, spec, any_whitespace=not params.disable_any_whitespace)


def parse_grammar(key: GrammarKey) -> Any:
    """The xgrammar Grammar of ``key``; StructuredOutputError with xgrammar's reason
    if the schema, regex or grammar is invalid or unsupported."""
    import xgrammar as xgr

    try:
        if key.kind == "json":
            _check_schema_supported(json.loads(key.spec))
            return _json_strings_fixed(
                xgr.Grammar.from_json_schema(key.spec, any_whitespace=key.any_whitespace, strict_mode=True))
        if key.kind == "json_object":
            # Any JSON object (as OpenAI's json_object mode), not any JSON value.
            return _json_strings_fixed(xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=key.any_whitespace, strict_mode=False))
        if key.kind == "regex":
            return xgr.Grammar.from_regex(key.spec)
        if key.kind == "choice":
            # Each choice as an EBNF string literal; JSON's escapes are EBNF's.
            literals = [json.dumps(choice, ensure_ascii=False) for choice in json.loads(key.spec)]
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(literals))
        if key.kind == "grammar":
            return xgr.Grammar.from_ebnf(key.spec)
        if key.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(key.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = _XGRAMMAR_ERROR_PREFIX.sub("", str(exc).strip()).splitlines()[0]
        raise StructuredOutputError(f"the {key.kind} constraint does not compile: {reason}") from None
    raise AssertionError(f"unknown constraint kind {key.kind!r}")


def _json_strings_fixed(grammar: Any) -> Any:
    """``grammar`` with JSON's class of unescaped string characters wherever xgrammar
    wrote a looser one (see _XGRAMMAR_STRING_CHARS)."""
    import xgrammar as xgr

    text = str(grammar)
    if not any(chars in text for chars in _XGRAMMAR_STRING_CHARS):
        return grammar
    for chars in _XGRAMMAR_STRING_CHARS:
        text = text.replace(chars, _JSON_STRING_CHAR)
    return xgr.Grammar.from_ebnf(text)


def _check_schema_supported(schema: Any) -> None:
    """Reject what xgrammar would silently ignore: a string schema with both a
    pattern and minLength/maxLength (it drops the length bounds)."""
    if isinstance(schema, dict):
        if isinstance(schema.get("pattern"), str) and any(
                isinstance(schema.get(name), int) for name in ("minLength", "maxLength")):
            raise StructuredOutputError(f"a string schema with both pattern and minLength/maxLength is not "
                                        f"supported (the length bounds would be ignored): {schema!r}")
        values = schema.values()
    elif isinstance(schema, list):
        values = schema
    else:
        return
    for value in values:
        _check_schema_supported(value)


class GrammarState:
    """One sample's grammar matcher and how many tokens it has accepted."""

    def __init__(self, compiled: Any, stop_token_ids: list[int], kind: str) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        self.kind = kind
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        accepted = self.matcher.accept_token(token_id)
        self.num_accepted += accepted
        return accepted

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and accepted its stop token: nothing may follow."""
        return self.matcher.is_terminated()


class GrammarCompiler:
    """The engine's grammars: parsed at add time, compiled in the background, cached.

    Built with the engine; xgrammar's tokenizer info, compiler and worker thread are
    made on the first structured request, so engines without one pay nothing.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._entries: OrderedDict[GrammarKey, tuple[Any, Future]] = OrderedDict()
        self._lock = threading.Lock()  # the worker thread builds the compiler lazily
        self._compiler: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._batch_matcher: Any = None

    def submit(self, request_id: str, params: StructuredOutputsParams) -> Future:
        """Check that ``params`` compiles (StructuredOutputError naming the request if
        not) and return the future of its compiled grammar, shared with every earlier
        request that had the same constraint."""
        try:
            key = grammar_key(params)
            entry = self._entries.get(key)
            if entry is None:
                entry = (parse_grammar(key), None)
        except StructuredOutputError as exc:
            raise StructuredOutputError(f"request {request_id!r}: {exc}") from None
        grammar, future = entry
        if future is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardline-grammar")
            future = self._executor.submit(self._compile, grammar)
        self._entries[key] = (grammar, future)
        self._entries.move_to_end(key)
        while len(self._entries) > MAX_CACHED_GRAMMARS:
            self._entries.popitem(last=False)
        return future

    def _compile(self, grammar: Any) -> Any:
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                # Our own cache is the one that counts (keyed by constraint, bounded).
                self._compiler = xgr.GrammarCompiler(info, max_threads=_XGRAMMAR_THREADS, cache_enabled=False)
        return self._compiler.compile_grammar(grammar)

    def fill_bitmask(self, grammars: list[GrammarState], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill ``bitmask`` rows ``rows`` with the next-token masks of ``grammars``
        (one call for the batch; xgrammar fills them on its own threads)."""
        import xgrammar as xgr

        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=_XGRAMMAR_THREADS)
        self._batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)

    def close(self) -> None:
        """Stop the compile thread (pending compilations are cancelled)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(V / 32)] int32, every token allowed. Bit j of word w is token
    32 * w + j (xgrammar's layout)."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allow_only(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Restrict ``row`` to the single token ``token_id``."""
    bitmask[row] = 0
    allow_token(bitmask, row, token_id)


def allow_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    bitmask[row, word] |= _bit(bit)


def is_allowed(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    word, bit = divmod(token_id, 32)
    return bool(int(bitmask[row, word]) & _bit(bit))


def allows_only(bitmask: torch.Tensor, row: int, token_ids: set[int]) -> bool:
    """Whether ``row`` allows no token outside ``token_ids``."""
    remaining = bitmask[row].clone()
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        if word < remaining.shape[0]:
            remaining[word] &= ~_bit(bit)
    return not bool(remaining.any())


def _bit(bit: int) -> int:
    """The int32 value with only ``bit`` set (bit 31 is the sign bit)."""
    return -(1 << 31) if bit == 31 else 1 << bit


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits with every token the bitmask forbids set to -inf, as one masked fill
    over the batch, on the logits' device. logits: [N, V]; bitmask: [N, ceil(V / 32)]."""
    num_rows, vocab_size = logits.shape
    assert bitmask.shape == (num_rows, (vocab_size + 31) // 32), (bitmask.shape, logits.shape)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(num_rows, -1)[:, :vocab_size].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def step_bitmask(compiler: GrammarCompiler, grammars: list[GrammarState | None],
                 trackers: list[ReasoningTracker | None], vocab_size: int) -> tuple[torch.Tensor | None, set[int]]:
    """The bitmask of one step's rows and the set of rows it restricts (None and an
    empty set when it restricts none).

    A row whose reasoning budget is spent may only end its reasoning; a row with a
    grammar follows it once its reasoning is over (before its first token, a Qwen3
    style row may also open its reasoning instead); every other row is free.
    """
    grammar_rows, row_grammars, open_tags, forced = [], [], [], []
    for row, (grammar, tracker) in enumerate(zip(grammars, trackers)):
        if tracker is not None and tracker.must_end_reasoning:
            forced.append((row, tracker.parser.end_token_id))
        elif grammar is not None and (tracker is None or tracker.phase is not Phase.REASONING):
            grammar_rows.append(row)
            row_grammars.append(grammar)
            if tracker is not None and tracker.phase is Phase.UNDECIDED:
                open_tags.append((row, tracker.parser.start_token_id))
    if not grammar_rows and not forced:
        return None, set()
    bitmask = new_bitmask(len(grammars), vocab_size)
    if grammar_rows:
        compiler.fill_bitmask(row_grammars, bitmask, grammar_rows)
    for row, token_id in open_tags:
        allow_token(bitmask, row, token_id)
    for row, token_id in forced:
        allow_only(bitmask, row, token_id)
    return bitmask, set(grammar_rows) | {row for row, _ in forced}


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

    def hold(self, rows: list[SampleRow], logits: torch.Tensor | None, state_of: Callable[[str], RequestState],
             failures: dict[str, StructuredOutputError]) -> tuple[list[SampleRow], torch.Tensor | None]:
        """The rows that may sample now, and their logits; the others are held."""
        keep = []
        for i, row in enumerate(rows):
            sequence_id = row.request.request_id
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

    def release(self, rows: list[SampleRow], logits: torch.Tensor | None, state_of: Callable[[str], RequestState],
                row_of: Callable[[str], SampleRow], failures: dict[str, StructuredOutputError],
                ) -> tuple[list[SampleRow], torch.Tensor | None]:
        """``rows`` plus the held sequences whose grammar has compiled, with their
        logits appended; with no other row to sample, first waits for a grammar."""
        if not self._held_logits:
            return rows, logits
        if not rows:
            wait({state_of(s).grammar for s in self._held_logits} - {None}, return_when=FIRST_COMPLETED)
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
        for sample in state.samples:
            sample.grammar = GrammarState(future.result(), stop_ids, state.params.structured_outputs.kind)
        state.grammar = None
        return True

    def bitmask(self, rows: list[SampleRow], samples: list[SampleState]) -> tuple[torch.Tensor | None, set[int]]:
        """The step's bitmask and restricted rows (see ``step_bitmask``). min_tokens
        yields where a grammar allows nothing but ending: the output must parse."""
        bitmask, restricted = step_bitmask(self.compiler, [s.grammar for s in samples],
                                           [s.reasoning for s in samples], self.vocab_size)
        for i in restricted:
            blocked = rows[i].blocked_token_ids
            if blocked and samples[i].grammar is not None and allows_only(bitmask, i, set(blocked)):
                rows[i].blocked_token_ids = ()
        return bitmask, restricted

    def close(self) -> None:
        self.compiler.close()
