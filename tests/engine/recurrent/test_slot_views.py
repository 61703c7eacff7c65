"""A recurrent layer runs on views of the slot tensors when a step's slots form one
consecutive range, in any batch order (its requests then run in slot order), and
gathers and scatters the states otherwise: both give the same outputs and leave the
same states in every slot."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from shardline.engine.attention.context import StepBatch
from shardline.engine.recurrent.gated_delta_net import GATED_DELTA_NET
from shardline.engine.recurrent.state import RecurrentLayer, RecurrentStateSpec, RecurrentStep

from .mixer_parity import randomize

HIDDEN = 32
CONFIG = transformers.Qwen3_5TextConfig(hidden_size=HIDDEN, linear_num_value_heads=4, linear_num_key_heads=2,
                                        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                        num_hidden_layers=1, layer_types=["linear_attention"])
NUM_SLOTS = 6


def _step(layer: RecurrentLayer, states: dict, slots: list[int], lengths: list[int], continuing: list[bool],
          hidden: torch.Tensor) -> torch.Tensor:
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    batch = StepBatch(slot_mapping=torch.zeros(sum(lengths), dtype=torch.int64), query_start_loc=cu_seqlens,
                      seq_lens=torch.tensor(lengths), block_tables=torch.zeros((len(lengths), 1), dtype=torch.int32),
                      kv_caches=[], max_query_len=max(lengths), max_seq_len=max(lengths))
    step = RecurrentStep(slots=torch.tensor(slots), has_initial_state=torch.tensor(continuing), states={0: states})
    with torch.no_grad():
        return layer(hidden[None], shardline_ctx=batch, shardline_state=step)[0]


@pytest.mark.parametrize("slots", [[3, 1, 2], [1, 2, 3]], ids=["permuted", "in-order"])
def test_slot_views_match_the_gathered_states(slots):
    layer = RecurrentLayer(randomize(Qwen3_5GatedDeltaNet(CONFIG, 0), seed=0), GATED_DELTA_NET, 0, CONFIG)
    spec = RecurrentStateSpec.from_layers({0: layer})
    generator = torch.Generator().manual_seed(1)
    viewed, gathered = (spec.allocate(NUM_SLOTS, torch.device("cpu"))[0] for _ in range(2))
    # The gathered run's slots: the same requests in slots no consecutive range holds.
    scattered = {1: 0, 2: 5, 3: 2}
    for lengths, continuing in (([5, 9, 1], [False, False, False]), ([1, 4, 1], [True, True, True]),
                                ([1, 1, 1], [True, True, True]), ([2, 3, 1], [True, False, True])):
        hidden = torch.randn(sum(lengths), HIDDEN, generator=generator).to(layer.layer.out_proj.weight.dtype)
        out_viewed = _step(layer, viewed, slots, lengths, continuing, hidden)
        out_gathered = _step(layer, gathered, [scattered[s] for s in slots], lengths, continuing, hidden)
        torch.testing.assert_close(out_viewed, out_gathered, rtol=1e-5, atol=1e-6)
        for slot in slots:
            for name in viewed:
                torch.testing.assert_close(viewed[name][slot], gathered[name][scattered[slot]], rtol=1e-5, atol=1e-6)
