"""Token bitmasks: one [N, ceil(V / 32)] int32 tensor per step for the whole batch
(xgrammar's layout: bit j of word w allows token 32 * w + j), filled on the host in
one call and applied to the whole batch's logits at once, never row by row.

Invariant: a row that nothing restricts is all ones, so applying the batch's bitmask
leaves its logits bit for bit as they were: constrained and unconstrained rows of
one batch do not affect each other.
"""

from __future__ import annotations

import contextlib

import torch
import xgrammar

from ...kernels._triton import KERNEL_DTYPES, interpreter_active, launcher
from ..harmony import HarmonyTracker
from ..reasoning import Phase, ReasoningTracker
from .grammar import GrammarCompiler, GrammarState

# CUDA logits are masked by xgrammar's Triton kernel (the backend its own
# apply_token_bitmask_inplace picks for CUDA). Not its "cuda" backend: that compiles
# a .cu file with nvcc when first imported, a toolkit a worker need not have. Not
# "torch_compile": a compile per batch shape. The Triton kernel needs only Triton (the
# engine's GPU dependency) and runs on CPU tensors under Triton's interpreter, where
# the tests compare it with the reference. Its launcher is ours
# (``apply_token_bitmask_triton``): xgrammar's sizes the grid from device 0 and
# launches on the current device, whatever the logits' device, and cannot run on CPU
# tensors. Without Triton, CUDA logits take the reference.
try:
    from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_kernel
except ImportError:
    apply_token_bitmask_inplace_kernel = None


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
    logits: [N, V]; bitmask: [N, ceil(V / 32)] int32 on the host. V is the engine's
    vocabulary (the model's logits width), which can exceed the tokenizer's: the
    grammar leaves the padded ids' bits clear, so every path masks those columns.

    The result may be ``logits`` itself, masked in place, or a new tensor: callers use
    the returned tensor and must not read ``logits`` again. On CPU the logits are
    masked in place, whole forbidden words by torch and the rest by xgrammar's CPU
    kernel (see ``mask_by_words``); on CUDA in place by xgrammar's Triton kernel
    (``apply_token_bitmask_triton``) where it takes the dtype and layout (float32,
    float16, bfloat16, last dimension contiguous); anywhere else (another device,
    float64 CUDA logits, no Triton, a row whose tokens are not contiguous) through
    ``apply_token_bitmask_reference``, which tests compare every path with.
    """
    num_rows, vocab_size = logits.shape
    assert bitmask.shape == (num_rows, (vocab_size + 31) // 32) and bitmask.dtype == torch.int32, (
        bitmask.shape, bitmask.dtype, logits.shape)
    if logits.device.type == "cpu" and bitmask.device.type == "cpu" and logits.stride(1) == 1:
        mask_by_words(logits, bitmask)
        return logits
    if logits.device.type == "cuda" and triton_kernel_takes(logits):
        apply_token_bitmask_triton(logits, bitmask.to(logits.device, non_blocking=True).contiguous())
        return logits
    return apply_token_bitmask_reference(logits, bitmask)


def triton_kernel_takes(logits: torch.Tensor) -> bool:
    """Whether xgrammar's Triton kernel can mask ``logits`` ([N, V]): Triton is
    installed, the dtype is one it stores (float64 is not: the launch would need more
    warps than a block holds) and each row's tokens are contiguous (it indexes a row
    by its stride alone)."""
    return (apply_token_bitmask_inplace_kernel is not None and logits.dtype in KERNEL_DTYPES
            and logits.stride(1) == 1)


# Tokens one program masks per iteration (xgrammar's launcher's choice): 128 words.
_KERNEL_BLOCK_SIZE = 4096
# Programs launched under Triton's interpreter (on CUDA: one per SM). Fewer programs
# than blocks, so each program's loop over blocks is exercised.
_INTERPRETER_PROGRAMS = 3


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask ``logits`` in place with xgrammar's Triton kernel: a persistent grid, one
    program per SM, each looping over (row, 4096-token block) pairs. logits: [N, V]
    float32, float16 or bfloat16, last dimension contiguous, on CUDA (or on CPU under
    Triton's interpreter); bitmask: [N, ceil(V / 32)] int32, contiguous, on the same
    device. The kernel masks the first V columns (bits past V in a row's last word
    are ignored) and reads a row's words up to its stride, hence the contiguity."""
    assert apply_token_bitmask_inplace_kernel is not None, "Triton is not installed"
    num_rows, vocab_size = logits.shape
    assert logits.dtype in KERNEL_DTYPES and logits.stride(1) == 1, (logits.dtype, logits.stride())
    assert (bitmask.device == logits.device and bitmask.dtype == torch.int32 and bitmask.is_contiguous()
            and bitmask.shape == (num_rows, (vocab_size + 31) // 32)), (bitmask.device, bitmask.dtype,
                                                                        bitmask.shape, bitmask.stride())
    # Row offsets are computed in int32 inside the kernel.
    assert num_rows * logits.stride(0) < 2**31, (num_rows, logits.stride())
    if num_rows == 0:
        return
    if logits.device.type == "cuda":
        properties = torch.cuda.get_device_properties(logits.device)
        num_programs, warp_size = properties.multi_processor_count, getattr(properties, "warp_size", 32)
        # Triton launches on the current device: make it the logits' one.
        device_scope = torch.cuda.device(logits.device)
    else:
        assert interpreter_active(), "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)"
        num_programs, warp_size, device_scope = _INTERPRETER_PROGRAMS, 32, contextlib.nullcontext()
    # xgrammar's launch: each thread stores 16 bytes of a 4096-token block.
    num_warps = _KERNEL_BLOCK_SIZE // warp_size // (16 // logits.element_size())
    with device_scope:
        launcher(apply_token_bitmask_inplace_kernel, (num_programs,))(
            logits, bitmask, None, num_rows, vocab_size, logits.stride(0), bitmask.stride(0),
            num_programs, _KERNEL_BLOCK_SIZE, num_warps=num_warps, num_stages=3)


# The int32 value of each of a word's 32 bits (bit 31 is the sign bit).
_WORD_BITS = torch.tensor([_bit(bit) for bit in range(32)], dtype=torch.int32)


# The logits dtypes xgrammar's CPU kernel masks (it refuses float64).
XGRAMMAR_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def mask_by_words(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask ``logits`` (CPU, last dimension contiguous) in place. A grammar's row is
    mostly words that forbid all 32 tokens (a JSON value's position allows a handful
    of tokens) or allow all 32 (inside a free string, and every unrestricted row).
    Words that forbid all 32 are filled a word at a time (``fill_forbidden_words``,
    where xgrammar's CPU kernel would test each of their bits); the rest goes to
    xgrammar's CPU kernel, which skips words allowing all 32 without a pass over their
    logits (as a torch fill could not) and unpacks the mixed ones in one C loop, or,
    for float64 logits it refuses, to ``mask_mixed_words``. bench_structured.py
    --kernels times these paths on the three kinds of masks."""
    remaining = fill_forbidden_words(logits, bitmask)
    if logits.dtype in XGRAMMAR_CPU_DTYPES:
        xgrammar.apply_token_bitmask_inplace(logits, remaining, vocab_size=logits.shape[1], backend="cpu")
    else:
        mask_mixed_words(logits, remaining)


def fill_forbidden_words(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf, in place, the 32 logits of every whole word of ``bitmask`` that
    forbids them all (only those words' logits are written). Returns the bitmask left
    to apply: ``bitmask`` itself when no word was filled, else a copy with the filled
    words set to all ones. logits: [N, V] CPU, last dimension contiguous."""
    num_words = logits.shape[1] // 32  # whole words; a partial last word is left
    forbidden_words = bitmask[:, :num_words] == 0  # [N, W]
    rows, columns = forbidden_words.nonzero(as_tuple=True)
    if not rows.numel():
        return bitmask
    blocks = logits[:, :32 * num_words].unflatten(1, (num_words, 32))  # [N, W, 32], a view
    blocks[rows, columns] = float("-inf")
    remaining = bitmask.clone()
    remaining[:, :num_words].masked_fill_(forbidden_words, -1)
    return remaining


def mask_mixed_words(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask ``logits`` (CPU, last dimension contiguous) in place in torch ops: words
    allowing all 32 tokens are left alone, every other word is gathered, unpacked bit
    by bit and scattered back, and a partial last word is masked on its own."""
    vocab_size = logits.shape[1]
    num_words = vocab_size // 32
    words = bitmask[:, :num_words]  # [N, W]
    rows, columns = (words != -1).nonzero(as_tuple=True)
    if rows.numel():
        blocks = logits[:, :32 * num_words].unflatten(1, (num_words, 32))  # [N, W, 32], a view
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
            # Only a tag-opened reasoning row (not harmony's) starts undecided.
            if isinstance(tracker, ReasoningTracker) and tracker.phase is Phase.UNDECIDED:
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
