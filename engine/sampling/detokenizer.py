"""Incremental detokenization and stop-string detection.

Text is produced by decoding a short window of recent tokens and emitting only
what the newest token added; a window ending in an incomplete UTF-8 sequence
("\ufffd") emits nothing until the bytes complete, so multi-byte characters split
across tokens come out whole.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Tokens of context kept before the emitted text, so that tokenizers that strip
# a leading space from a decode's first token still produce the right spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, one token at a time."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self._fast_decode = fast_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._special_ids = set(tokenizer.all_special_ids)
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
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add_token(self, token_id: int) -> str:
        """Append one token; return the text it completed (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode_window(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode_window(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence, emit what is still held back (an incomplete
        UTF-8 tail decodes to "\ufffd", as a full decode of the tokens would)."""
        prefix_text = self._decode_window(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode_window(self.token_ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


def fast_window_decoder(fast_decode, skip_special_tokens: bool):
    """``fast_decode`` with skip_special_tokens fixed (passed by position: the Rust
    binding parses keywords more slowly)."""

    def decode(token_ids: list[int]) -> str:
        return fast_decode(token_ids, skip_special_tokens)

    return decode


def spaced_specials(detokenizer: IncrementalDetokenizer) -> bool:
    """Whether special tokens are kept and spaced apart (decoded run by run)."""
    return not detokenizer.skip_special_tokens and detokenizer.spaces_between_special_tokens


def fast_decoder(tokenizer: PreTrainedTokenizerBase):
    """The Rust tokenizer's own decode, when ``tokenizer.decode`` would only wrap it.

    For a fast tokenizer whose decoding is not customised, ``tokenizer.decode`` with
    ``clean_up_tokenization_spaces=False`` returns exactly the backend's decode (and
    ignores ``spaces_between_special_tokens``); skipping its argument handling makes
    the two decodes per generated token several times cheaper. None otherwise."""
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(tokenizer, PreTrainedTokenizerFast) and type(tokenizer)._decode is PreTrainedTokenizerFast._decode \
            and hasattr(backend, "decode"):
        return backend.decode
    return None


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
