"""Grammars for structured outputs: a request's StructuredOutputsParams parsed into an
xgrammar Grammar (at add time, so a constraint that cannot compile is an error naming
the request), compiled against the tokenizer on a background thread once per
distinct constraint per engine, and one matcher per sample.

xgrammar's Python API is imported on first use: an engine without a structured
request never loads it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from ...params import StructuredOutputsParams

# Distinct constraints whose parsed and compiled grammars an engine keeps (least
# recently used dropped first); a job usually has one.
MAX_CACHED_GRAMMARS = 256
# Threads xgrammar uses to compile one grammar.
_COMPILE_THREADS = 2
# Threads xgrammar uses to fill a batch's bitmask: one. A JSON schema's masks take
# about a microsecond per row to fill from xgrammar's token mask cache, less than
# waking helper threads costs, and on a CPU engine such threads would compete with
# the forward's.
_FILL_THREADS = 1
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
    """One sample's grammar matcher, how many tokens it has accepted, and whether it
    is terminated (the grammar is complete and accepted its stop token: nothing may
    follow). Only an accepted token changes the matcher (it is never rolled back: see
    the package's invariants), so ``is_terminated`` is read from xgrammar then."""

    def __init__(self, compiled: Any, stop_token_ids: list[int], kind: str) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        self.kind = kind
        self.num_accepted = 0
        self.is_terminated = False

    def accept(self, token_id: int) -> bool:
        accepted = self.matcher.accept_token(token_id)
        if accepted:
            self.num_accepted += 1
            self.is_terminated = self.matcher.is_terminated()
        return accepted


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
                self._compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS, cache_enabled=False)
        return self._compiler.compile_grammar(grammar)

    def fill_bitmask(self, grammars: list[GrammarState], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill ``bitmask`` rows ``rows`` with the next-token masks of ``grammars``
        (one call for the batch)."""
        import xgrammar as xgr

        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=_FILL_THREADS)
        self._batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)

    def close(self) -> None:
        """Stop the compile thread (pending compilations are cancelled)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
