"""Token bitmasks: one [N, ceil(V / 32)] int32 tensor per step for the whole batch
(xgrammar's layout: bit j of word w allows token 32 * w + j), filled on the host in
one call and applied to the whole batch's logits at once, never row by row.

Invariant: a row that nothing restricts is all ones, so applying the batch's bitmask
leaves its logits bit for bit as they were: constrained and unconstrained rows of
one batch do not affect each other.
"""

from __future__ import annotations

import torch

from ..harmony import HarmonyTracker
from ..reasoning import Phase, ReasoningTracker
from .grammar import GrammarCompiler, GrammarState


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
    """Logits with every token the bitmask forbids set to -inf, over the whole batch.
    logits: [N, V]; bitmask: [N, ceil(V / 32)] int32 on the host.

    On CPU the logits are masked in place a word (32 tokens) at a time (see
    ``_mask_by_words``); elsewhere, or when a row's tokens are not contiguous, through
    ``apply_token_bitmask_reference`` (one unpack and one masked fill on the device),
    which tests compare the CPU path with.
    """
    num_rows, vocab_size = logits.shape
    assert bitmask.shape == (num_rows, (vocab_size + 31) // 32) and bitmask.dtype == torch.int32, (
        bitmask.shape, bitmask.dtype, logits.shape)
    if logits.device.type != "cpu" or bitmask.device.type != "cpu" or logits.stride(1) != 1:
        return apply_token_bitmask_reference(logits, bitmask)
    _mask_by_words(logits, bitmask)
    return logits


# The int32 value of each of a word's 32 bits (bit 31 is the sign bit).
_WORD_BITS = torch.tensor([_bit(bit) for bit in range(32)], dtype=torch.int32)


def _mask_by_words(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask ``logits`` (CPU, last dimension contiguous) in place. A grammar's row is
    mostly words that forbid all 32 tokens (a JSON value's position allows a handful
    of tokens) or allow all 32 (inside a free string, and every unrestricted row): the
    first are filled by one broadcast fill, the second left alone, and only the few
    words that mix both are unpacked bit by bit. This is several times faster than
    unpacking every bit, xgrammar's CPU kernel included, on such masks."""
    num_rows, vocab_size = logits.shape
    num_words = vocab_size // 32  # whole words; a partial last word is the tail
    words = bitmask[:, :num_words]  # [N, W]
    blocks = logits[:, :32 * num_words].unflatten(1, (num_words, 32))  # [N, W, 32], a view
    blocks.masked_fill_((words == 0)[:, :, None], float("-inf"))
    rows, columns = ((words != 0) & (words != -1)).nonzero(as_tuple=True)
    if rows.numel():
        mixed = blocks[rows, columns]  # [M, 32], a copy
        forbidden = (words[rows, columns][:, None] & _WORD_BITS) == 0
        blocks[rows, columns] = mixed.masked_fill_(forbidden, float("-inf"))
    tail = vocab_size - 32 * num_words
    if tail:
        forbidden = (bitmask[:, num_words:] & _WORD_BITS[:tail]) == 0  # [N, tail]
        logits[:, 32 * num_words:].masked_fill_(forbidden, float("-inf"))


# The bit of each of a byte's 8 tokens (the bitmask's int32 words, little-endian, are
# 4 such bytes: token 32 * w + 8 * k + j is bit j of byte k of word w).
_BYTE_BITS = (1, 2, 4, 8, 16, 32, 64, 128)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Plain-torch ``apply_token_bitmask`` on any device and dtype: the bitmask is
    unpacked bytewise into a [N, V] forbidden mask and applied by one masked fill."""
    num_rows, vocab_size = logits.shape
    packed = bitmask.to(logits.device, non_blocking=True).contiguous().view(torch.uint8)  # [N, 4W]
    bits = torch.tensor(_BYTE_BITS, dtype=torch.uint8).to(logits.device, non_blocking=True)
    forbidden = ((packed[:, :, None] & bits) == 0).view(num_rows, -1)[:, :vocab_size]
    return logits.masked_fill(forbidden, float("-inf"))


def forbidden_picks(bitmask: torch.Tensor | None, rows: set[int], token_ids: list[int]) -> set[int]:
    """The rows among ``rows`` whose sampled token the (host) bitmask forbids, in one
    gather: rows where the other sampling constraints left no allowed token."""
    if bitmask is None or not rows:
        return set()
    ordered = sorted(rows)
    tokens = torch.tensor([token_ids[row] for row in ordered], dtype=torch.int64)
    words = bitmask[torch.tensor(ordered, dtype=torch.int64), tokens // 32].to(torch.int64)
    allowed = ((words >> (tokens % 32)) & 1).tolist()
    return {row for row, bit in zip(ordered, allowed) if not bit}


def step_bitmask(compiler: GrammarCompiler, grammars: list[GrammarState | None],
                 trackers: list[ReasoningTracker | HarmonyTracker | None],
                 vocab_size: int) -> tuple[torch.Tensor | None, set[int]]:
    """The bitmask of one step's rows and the set of rows it restricts (None and an
    empty set when it restricts none).

    A row whose reasoning budget is spent may only take its forced token (the end
    tag, or the next of harmony's tokens that open the final channel); a row with a
    grammar follows it in its answer (before its first token, a Qwen3 style row may
    also open its reasoning instead), not while it reasons or writes a harmony
    header; every other row is free.
    """
    grammar_rows, row_grammars, open_tags, forced = [], [], [], []
    for row, (grammar, tracker) in enumerate(zip(grammars, trackers)):
        if tracker is not None and tracker.forced_token_id is not None:
            forced.append((row, tracker.forced_token_id))
        elif grammar is not None and (tracker is None or tracker.phase in (Phase.ANSWER, Phase.UNDECIDED)):
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
