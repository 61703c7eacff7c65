"""The lightning-attention kind against Hugging Face's MiniMaxLightningAttention
(float64, random weights): packed, chunked and decode schedules give the module's
output on each sequence alone, and its final key-value state."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

from shardline.engine.recurrent.linear_attention import LIGHTNING

from .mixer_parity import chunked, make_sequences, prefill_then_decode, randomize, run_schedule, whole

LENGTHS = [9, 1, 70, 3, 6]
HIDDEN = 16


@pytest.fixture(scope="module")
def lightning_case():
    config = transformers.MiniMaxConfig(
        hidden_size=HIDDEN, num_attention_heads=4, head_dim=8, num_hidden_layers=3, block_size=4,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
    )
    layer = randomize(MiniMaxLightningAttention(config, layer_idx=1), seed=0)
    sequences = make_sequences(LENGTHS, HIDDEN, seed=1)
    references = []
    for sequence in sequences:
        with torch.no_grad():
            out, state = layer(sequence[None], position_embeddings=None, attention_mask=None)
        references.append((out[0], state[0].transpose(-1, -2)))  # [H, d_k, d_v] -> the kind's [H, d_v, d_k]
    return layer, config, sequences, references


@pytest.mark.parametrize(
    "schedule", [whole(LENGTHS), chunked(LENGTHS, seed=2, max_chunk=67), prefill_then_decode(LENGTHS, 4)],
    ids=["whole", "chunked", "decode"],
)
def test_lightning_kind_matches_the_hf_layer(lightning_case, schedule):
    layer, config, sequences, references = lightning_case
    outputs, states = run_schedule(LIGHTNING, layer, config, sequences, schedule)
    # HF's block path reads decay tables it built in float32 at init (its decode path
    # computes them in float64), so agreement is to float32 rounding.
    for i, (expected, expected_state) in enumerate(references):
        torch.testing.assert_close(outputs[i], expected, rtol=1e-6, atol=1e-6, msg=f"sequence {i} output")
        torch.testing.assert_close(states[i]["kv"], expected_state, rtol=1e-6, atol=1e-6, msg=f"sequence {i} state")
