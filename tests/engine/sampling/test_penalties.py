"""Penalties applied at the seen tokens only equal the whole-vocabulary formulas."""

from __future__ import annotations

import random

import pytest
import torch

from shardline.engine.sampling.sampler import penalise


def dense_penalties(logits: torch.Tensor, prompt_tokens: list[list[int]], output_tokens: list[list[int]],
                    repetition: list[float], frequency: list[float], presence: list[float]) -> torch.Tensor:
    """vLLM's penalties over [N, V] count and seen tensors, op for op."""
    num_rows, vocab_size = logits.shape
    output_counts = torch.zeros((num_rows, vocab_size), dtype=torch.int64)
    prompt_seen = torch.zeros((num_rows, vocab_size), dtype=torch.bool)
    for row in range(num_rows):
        for token in output_tokens[row]:
            output_counts[row, token] += 1
        prompt_seen[row, prompt_tokens[row]] = True
    dtype = logits.dtype
    rep = torch.tensor(repetition, dtype=dtype)[:, None]
    freq = torch.tensor(frequency, dtype=dtype)[:, None]
    pres = torch.tensor(presence, dtype=dtype)[:, None]
    seen = prompt_seen | (output_counts > 0)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - freq * output_counts.to(dtype)
    return logits - pres * (output_counts > 0).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_penalties_at_seen_tokens_equal_the_dense_formulas(dtype):
    rng = random.Random(0)
    vocab_size, num_rows = 97, 6
    logits = (torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    logits[0, :5] = float("-inf")  # banned tokens stay banned
    # Rows with repeats, an empty prompt, no output, nothing at all, and every token.
    prompt_tokens = [[rng.randrange(vocab_size) for _ in range(rng.randrange(1, 30))] for _ in range(num_rows)]
    output_tokens = [[rng.randrange(vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(num_rows)]
    prompt_tokens[1], output_tokens[2] = [], []
    prompt_tokens[3], output_tokens[3] = [], []
    output_tokens[4] = list(range(vocab_size)) * 2
    repetition = [rng.uniform(0.5, 2.0) for _ in range(num_rows)]
    frequency = [rng.uniform(-2.0, 2.0) for _ in range(num_rows)]
    presence = [rng.uniform(-2.0, 2.0) for _ in range(num_rows)]
    args = (prompt_tokens, output_tokens, repetition, frequency, presence)
    got = penalise(logits, *args)
    assert torch.equal(got, dense_penalties(logits, *args))
    assert not torch.equal(got, logits)  # the penalties changed something, so the test can fail
    assert torch.equal(got[3], logits[3])  # a row that has seen nothing keeps its logits


def test_ids_past_the_vocabulary_have_no_logit_to_penalise():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(1))
    got = penalise(logits, [[3, 12], []], [[15], [4, 4]], [2.0, 1.0], [0.0, 0.5], [0.0, 1.0])
    expected = dense_penalties(logits, [[3], []], [[], [4, 4]], [2.0, 1.0], [0.0, 0.5], [0.0, 1.0])
    assert torch.equal(got, expected)
