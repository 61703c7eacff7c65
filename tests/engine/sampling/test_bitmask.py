"""Each path that applies a structured-output bitmask agrees exactly with
apply_token_bitmask_reference: the CPU path (whole forbidden words filled by torch,
the rest by xgrammar's CPU kernel, or by torch ops for float64), and xgrammar's
Triton kernel (the CUDA path) on CPU tensors through Triton's interpreter, or on the
GPU where there is one. The CUDA dispatch itself is tested where CUDA is present."""

from __future__ import annotations

import pytest
import torch

from shardline.engine.sampling.structured import (
    allow_only,
    allow_token,
    apply_token_bitmask,
    apply_token_bitmask_reference,
)
from shardline.engine.sampling.structured import bitmask as bitmask_module
from shardline.engine.sampling.structured.bitmask import (
    apply_token_bitmask_triton,
    fill_forbidden_words,
    mask_mixed_words,
    new_bitmask,
    triton_kernel_takes,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Not multiples of 32 (a partial last word), one under a word, and one past two of
# the Triton kernel's 4096-token blocks.
VOCAB_SIZES = [1000, 31, 8227]
needs_triton = pytest.mark.skipif(bitmask_module.apply_token_bitmask_inplace_kernel is None,
                                  reason="Triton is not installed: CUDA logits take the reference")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: the CUDA dispatch cannot run here")

# Rows of make_batch's bitmask, by what they hold.
UNRESTRICTED, BLOCKED, ONE_TOKEN, PADDED_VOCAB = 0, 1, 5, 6


def make_batch(vocab_size: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [8, V] and a host bitmask whose rows are: unrestricted (every bit set,
    those past V included), all blocked, random bits, whole forbidden words between
    mixed ones, whole allowed words between mixed ones, one token in the last word,
    a grammar's row over a tokenizer smaller than V (ids past it forbidden, bits past
    V clear), and a sparse row allowing a handful of tokens."""
    generator = torch.Generator().manual_seed(seed)
    num_rows, num_words = 8, (vocab_size + 31) // 32
    logits = (torch.randn(num_rows, vocab_size, generator=generator) * 4).to(dtype)
    bitmask = new_bitmask(num_rows, vocab_size)
    bitmask[1:] = torch.randint(-2**31, 2**31 - 1, (num_rows - 1, num_words), dtype=torch.int32,
                                generator=generator)
    bitmask[BLOCKED] = 0
    bitmask[3, ::2] = 0
    bitmask[4, 1::2] = -1
    allow_only(bitmask, ONE_TOKEN, vocab_size - 1)
    tokenizer_vocab = vocab_size - vocab_size // 5
    bitmask[PADDED_VOCAB] = 0
    for token_id in range(0, tokenizer_vocab, 3):
        allow_token(bitmask, PADDED_VOCAB, token_id)
    bitmask[7] = 0
    for token_id in torch.randint(0, vocab_size, (5,), generator=generator).tolist():
        allow_token(bitmask, 7, token_id)
    return logits, bitmask


def check_masked(masked: torch.Tensor, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """``masked`` equals the reference bit for bit, and the rows' meaning shows."""
    vocab_size = logits.shape[1]
    expected = apply_token_bitmask_reference(logits, bitmask)
    assert masked.dtype == logits.dtype
    assert torch.equal(masked.cpu(), expected.cpu())
    assert torch.equal(masked[UNRESTRICTED].cpu(), logits[UNRESTRICTED].cpu())
    assert (masked[BLOCKED] == float("-inf")).all()
    assert masked[ONE_TOKEN].isfinite().nonzero().flatten().tolist() == [vocab_size - 1]
    tokenizer_vocab = vocab_size - vocab_size // 5
    assert (masked[PADDED_VOCAB, tokenizer_vocab:] == float("-inf")).all()


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_cpu_path_matches_the_reference(dtype, vocab_size):
    logits, bitmask = make_batch(vocab_size, dtype)
    target = logits.clone()
    masked = apply_token_bitmask(target, bitmask)
    assert masked.data_ptr() == target.data_ptr()  # masked in place
    check_masked(masked, logits, bitmask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_cpu_torch_word_steps_match_the_reference(dtype, vocab_size):
    """The torch steps float64 logits take, in every dtype: alone (every word not all
    ones unpacked) and after the forbidden words are filled."""
    logits, bitmask = make_batch(vocab_size, dtype)
    alone = logits.clone()
    mask_mixed_words(alone, bitmask)
    check_masked(alone, logits, bitmask)
    filled = logits.clone()
    remaining = fill_forbidden_words(filled, bitmask)
    assert not (remaining[:, :vocab_size // 32] == 0).any()
    mask_mixed_words(filled, remaining)
    check_masked(filled, logits, bitmask)
    assert torch.equal(bitmask, make_batch(vocab_size, dtype)[1])  # the caller's bitmask is left as it was


def test_cpu_rows_not_contiguous_take_the_reference():
    logits, bitmask = make_batch(1000, torch.float32)
    transposed = logits.t().contiguous().t()  # same values, stride(1) != 1
    check_masked(apply_token_bitmask(transposed, bitmask), logits, bitmask)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_xgrammar_triton_kernel_matches_the_reference(dtype, vocab_size):
    logits, bitmask = make_batch(vocab_size, dtype, seed=vocab_size)
    target = logits.to(DEVICE)
    apply_token_bitmask_triton(target, bitmask.to(DEVICE))
    check_masked(target, logits, bitmask)


@needs_triton
def test_xgrammar_triton_kernel_writes_inside_each_rows_vocabulary_only():
    """Rows that are a view of a wider tensor (row stride past V): the columns past V
    stay as they were though the bitmask's last word has bits set past V."""
    logits, bitmask = make_batch(1000, torch.float32)
    wide = torch.randn(8, 1040).to(DEVICE)
    wide[:, :1000] = logits.to(DEVICE)
    outside = wide[:, 1000:].clone()
    apply_token_bitmask_triton(wide[:, :1000], bitmask.to(DEVICE))
    check_masked(wide[:, :1000], logits, bitmask)
    assert torch.equal(wide[:, 1000:], outside)


def test_triton_kernel_takes_only_the_dtypes_and_layout_it_stores():
    logits = torch.zeros(2, 64)
    available = bitmask_module.apply_token_bitmask_inplace_kernel is not None
    assert triton_kernel_takes(logits) is available
    assert triton_kernel_takes(logits.to(torch.bfloat16)) is available
    assert not triton_kernel_takes(logits.to(torch.float64))
    assert not triton_kernel_takes(logits.t().contiguous().t())


@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_logits_are_masked_in_place_by_the_triton_kernel(dtype):
    logits, bitmask = make_batch(8227, dtype)
    target = logits.cuda()
    masked = apply_token_bitmask(target, bitmask)  # the bitmask stays on the host, as the engine's
    assert masked.data_ptr() == target.data_ptr()
    check_masked(masked, logits, bitmask)


@needs_cuda
def test_cuda_float64_logits_take_the_reference():
    logits, bitmask = make_batch(1000, torch.float64)
    target = logits.cuda()
    masked = apply_token_bitmask(target, bitmask)
    assert masked.data_ptr() != target.data_ptr()
    check_masked(masked, logits, bitmask)
