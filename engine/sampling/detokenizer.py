"""Incremental detokenization and stop-string detection.

Text is produced by decoding a short window of recent tokens and emitting only
what the newest token added; a window ending in an incomplete UTF-8 sequence
("\ufffd") emits nothing until the bytes complete, so multi-byte characters split
across tokens come out whole.

Invariant of the shortcut (TokenizerDecoding.pieces): where a tokenizer's decode of
any window of "plain" tokens is the concatenation of their one-token decodes, a
plain token appended to a window of plain tokens that holds nothing back emits
exactly its own piece, so it is emitted without decoding. Every other step decodes
its two windows as the algorithm says, so the text is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# The Rust tokenizer's decode: (token ids, skip_special_tokens) -> text.
FastDecode = Callable[..., str]

# Tokens of context kept before the emitted text, so that tokenizers that strip
# a leading space from a decode's first token still produce the right spacing.
_CONTEXT_TOKENS = 5


class TokenizerDecoding:
    """How one tokenizer's token windows are decoded, decided once per tokenizer and
    shared by every detokenizer over it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.fast_decode = fast_decoder(tokenizer)
        self.special_ids = frozenset(tokenizer.all_special_ids)
        # Per token id, its text where the shortcut applies (None for other tokens);
        # None when it applies to no token of this tokenizer.
        self.pieces = plain_pieces(tokenizer) if self.fast_decode is not None else None


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, one token at a time."""

    # Slotted: with stop strings, every step reads every sequence's detokenizer.
    __slots__ = ("tokenizer", "_fast_decode", "skip_special_tokens", "spaces_between_special_tokens", "_special_ids",
                 "_pieces", "_decode_window", "token_ids", "prefix_offset", "read_offset", "text", "_plain_window")

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 decoding: TokenizerDecoding | None = None) -> None:
        decoding = decoding or TokenizerDecoding(tokenizer)
        self.tokenizer = tokenizer
        self._fast_decode = decoding.fast_decode
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._special_ids = decoding.special_ids
        self._pieces = decoding.pieces or ()
        # How a window is decoded, chosen once: in the common case the Rust decode itself.
        self._decode_window = (fast_window_decoder(self._fast_decode, skip_special_tokens)
                               if self._fast_decode is not None and not spaced_specials(self) else self._decode)
        # With spaces around special tokens, a special token ending the prompt would
        # put a space before the output: the window then starts at the output.
        spaced = not skip_special_tokens and spaces_between_special_tokens
        self.token_ids = [] if spaced else list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        # Whether tokens [prefix_offset, read_offset) are all plain (see the module's invariant).
        self._plain_window = self._all_plain(self.token_ids)

    def _all_plain(self, token_ids: list[int]) -> bool:
        pieces, num_pieces = self._pieces, len(self._pieces)
        return bool(num_pieces) and all(t < num_pieces and pieces[t] is not None for t in token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        if spaced_specials(self):
            return " ".join(self._decode_plain(run) for run in self._special_runs(token_ids))
        return self._decode_plain(token_ids)

    def _special_runs(self, token_ids: list[int]) -> list[list[int]]:
        """Split ids into runs: each special token alone, other tokens grouped."""
        special = self._special_ids
        runs: list[list[int]] = []
        for token_id in token_ids:
            if token_id in special or not runs or runs[-1][-1] in special:
                runs.append([token_id])
            else:
                runs[-1].append(token_id)
        return runs

    def _decode_plain(self, token_ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        text = self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str), "one list of ids decodes to one string"
        return text

    def add_token(self, token_id: int) -> str:
        """Append one token; return the text it completed (possibly empty)."""
        token_ids = self.token_ids
        if self._plain_window and self.read_offset == len(token_ids) and token_id < len(self._pieces):
            piece = self._pieces[token_id]
            if piece is not None:
                token_ids.append(token_id)
                self.prefix_offset = self.read_offset
                self.read_offset += 1
                self.text += piece
                return piece
        return self._add_decoded(token_id)

    def _add_decoded(self, token_id: int) -> str:
        """add_token by decoding both windows, as the algorithm says."""
        token_ids = self.token_ids
        token_ids.append(token_id)
        prefix_text = self._decode_window(token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode_window(token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(token_ids)
        self._plain_window = self._all_plain(token_ids[self.prefix_offset :])
        self.text += delta
        return delta

    def add_tokens(self, token_ids: list[int]) -> None:
        """add_token for each of ``token_ids`` in order, the text they complete kept in
        ``text``: a run of plain tokens appended while nothing is held back is emitted
        as its pieces put together."""
        pieces, num_pieces = self._pieces, len(self._pieces)
        if token_ids and max(token_ids) < num_pieces:
            token_pieces = [pieces[t] for t in token_ids]
        else:
            token_pieces = [pieces[t] if t < num_pieces else None for t in token_ids]
        index, end = 0, len(token_ids)
        while index < end:
            if self._plain_window and self.read_offset == len(self.token_ids):
                run_end = _first_none(token_pieces, index, end)
                if run_end > index:
                    self.token_ids += token_ids[index:run_end]
                    self.read_offset = len(self.token_ids)
                    self.prefix_offset = self.read_offset - 1
                    # _first_none found no None in [index, run_end).
                    self.text += "".join(cast("list[str]", token_pieces[index:run_end]))
                    index = run_end
                    continue
            self._add_decoded(token_ids[index])
            index += 1

    def flush(self) -> str:
        """At the end of the sequence, emit what is still held back (an incomplete
        UTF-8 tail decodes to "\ufffd", as a full decode of the tokens would)."""
        prefix_text = self._decode_window(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode_window(self.token_ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self._plain_window = True
        self.text += delta
        return delta


def _first_none(values: list[str | None], start: int, end: int) -> int:
    """Index of the first None in values[start:end], or end."""
    try:
        return values.index(None, start, end)
    except ValueError:
        return end


def fast_window_decoder(fast_decode: FastDecode, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``fast_decode`` with skip_special_tokens fixed (passed by position: the Rust
    binding parses keywords more slowly)."""

    def decode(token_ids: list[int]) -> str:
        return fast_decode(token_ids, skip_special_tokens)

    return decode


def spaced_specials(detokenizer: IncrementalDetokenizer) -> bool:
    """Whether special tokens are kept and spaced apart (decoded run by run)."""
    return not detokenizer.skip_special_tokens and detokenizer.spaces_between_special_tokens


def fast_decoder(tokenizer: PreTrainedTokenizerBase) -> FastDecode | None:
    """The Rust tokenizer's own decode, when ``tokenizer.decode`` would only wrap it.

    For a fast tokenizer whose decoding is not customised, ``tokenizer.decode`` with
    ``clean_up_tokenization_spaces=False`` returns exactly the backend's decode (and
    ignores ``spaces_between_special_tokens``); skipping its argument handling makes
    the two decodes per generated token several times cheaper. None otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (backend is not None and hasattr(backend, "decode") and isinstance(tokenizer, PreTrainedTokenizerFast)
            and type(tokenizer)._decode is PreTrainedTokenizerFast._decode):
        return backend.decode
    return None


def plain_pieces(tokenizer: PreTrainedTokenizerBase) -> list[str | None] | None:
    """Per token id, the token's text if it is plain, else None; None if no token is.

    Plain: the tokenizer's decoder is byte-level alone (its decode of any tokens is
    the UTF-8 decoding, invalid bytes replaced, of their bytes put together), the
    token is not an added token (those are decoded outside the decoder), and its
    one-token decode is non-empty and holds no "\ufffd". Its bytes are then valid
    UTF-8 on their own, so any window of plain tokens decodes to the concatenation
    of their texts, whether special tokens are skipped or not."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or type(backend.decoder) is not decoders.ByteLevel:
        return None
    added = backend.get_added_tokens_decoder()
    pieces: list[str | None] = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        piece = None if token_id in added else backend.decode([token_id], False)
        pieces.append(piece if piece and "\ufffd" not in piece else None)
    return pieces


def find_stop_string(text: str, delta_len: int, stop: list[str]) -> tuple[str, int] | None:
    """Earliest stop string that ends inside the newest ``delta_len`` characters.

    Returns (stop string, index where it starts in ``text``) or None. Only the tail
    that could hold a new match is searched, so strings spanning tokens are found.
    """
    best: tuple[str, int] | None = None
    for stop_str in stop:
        window_start = max(0, len(text) - delta_len - len(stop_str) + 1)
        index = text.find(stop_str, window_start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop_str, index)
    return best
