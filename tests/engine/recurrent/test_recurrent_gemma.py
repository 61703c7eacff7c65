"""The RG-LRU kind against Hugging Face's RecurrentGemmaRecurrentBlock (float64,
random weights; the recurrence accumulates in float32 there and here): packed,
chunked and decode schedules give the block's output on each sequence alone, and
its final conv window and recurrent state."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRecurrentBlock

from shardline.engine.recurrent.recurrent_gemma import RG_LRU, linear_recurrence_varlen

from .mixer_parity import chunked, make_sequences, prefill_then_decode, randomize, run_schedule, whole

LENGTHS = [9, 1, 40, 3, 6]
HIDDEN = 16


def hf_block_run(block, sequence):
    """The block on one sequence from a fresh state: (output, conv window [K-1, W], h [W])."""
    block.conv1d_state = None  # the block keeps its state on itself; start clean
    with torch.no_grad():
        out, _ = block(sequence[None], position_ids=torch.arange(len(sequence))[None], attention_mask=None)
    return out[0], block.conv1d_state[0].t(), block.rg_lru.recurrent_states[0]


@pytest.fixture(scope="module")
def block_case():
    config = transformers.RecurrentGemmaConfig(
        hidden_size=HIDDEN, lru_width=HIDDEN, num_attention_heads=2, conv1d_width=4, num_hidden_layers=2,
    )
    block = randomize(RecurrentGemmaRecurrentBlock(config, layer_idx=0), seed=0)
    sequences = make_sequences(LENGTHS, HIDDEN, seed=1)
    return block, config, sequences, [hf_block_run(block, s) for s in sequences]


@pytest.mark.parametrize(
    "schedule", [whole(LENGTHS), chunked(LENGTHS, seed=2, max_chunk=37), prefill_then_decode(LENGTHS, 4)],
    ids=["whole", "chunked", "decode"],
)
def test_rg_lru_kind_matches_the_hf_block(block_case, schedule):
    block, config, sequences, references = block_case
    outputs, states = run_schedule(RG_LRU, block, config, sequences, schedule)
    for i, (expected, conv, recurrent) in enumerate(references):
        torch.testing.assert_close(outputs[i], expected, rtol=1e-5, atol=1e-5, msg=f"sequence {i} output")
        torch.testing.assert_close(states[i]["conv"], conv, rtol=1e-10, atol=1e-10, msg=f"sequence {i} conv")
        torch.testing.assert_close(states[i]["recurrent"], recurrent, rtol=1e-5, atol=1e-5, msg=f"sequence {i} h")


@pytest.mark.parametrize("chunk_size", [1, 4, 32])
def test_linear_recurrence_matches_the_loop_from_saved_states(chunk_size):
    gen = torch.Generator().manual_seed(3)
    lengths, has_state = [5, 1, 11, 2], [True, False, True, False]
    total, width = sum(lengths), 3
    decay = torch.rand(total, width, generator=gen, dtype=torch.float64)
    inputs = torch.randn(total, width, generator=gen, dtype=torch.float64)
    initial = torch.randn(len(lengths), width, generator=gen, dtype=torch.float64)
    initial = initial * torch.tensor(has_state, dtype=torch.float64)[:, None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    states, final = linear_recurrence_varlen(decay, inputs, cu, initial, chunk_size=chunk_size)
    for b in range(len(lengths)):
        h = initial[b]
        for t in range(int(cu[b]), int(cu[b + 1])):
            h = decay[t] * h + inputs[t]
            torch.testing.assert_close(states[t], h, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(final[b], h, rtol=1e-12, atol=1e-12)
