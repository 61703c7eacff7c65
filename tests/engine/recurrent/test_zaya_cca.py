"""ZAYA's CCA projection kind against transformers' ZayaCCAProjection: packed requests
of several lengths, each split in chunks that continue the saved state, give the
module's own queries, keys and values over each whole sequence (float64)."""

from __future__ import annotations

import torch
import transformers
from transformers.models.zaya.modeling_zaya import ZayaCCAProjection

from shardline.engine.recurrent.zaya_cca import ZAYA_CCA


def _module() -> ZayaCCAProjection:
    config = transformers.AutoConfig.for_model("zaya", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=16, cca_time0=3, cca_time1=2, num_hidden_layers=1)
    torch.manual_seed(0)
    module = ZayaCCAProjection(config, layer_idx=0).double()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0, 0.2)
    return module


@torch.inference_mode()
def test_chunked_packed_requests_match_the_module():
    module = _module()
    lengths, chunk = (1, 7, 12), 4
    sequences = [torch.randn(length, 64, dtype=torch.float64) for length in lengths]
    expected = [torch.cat([x.flatten(2) for x in module(sequence[None], None)], dim=-1)[0] for sequence in sequences]
    states = {name: torch.full((len(lengths), *shape), float("nan"), dtype=dtype)  # a fresh slot's leftovers
              for name, (shape, dtype) in ZAYA_CCA.state_shapes(module, None).items()}
    outputs = [[] for _ in lengths]
    for start in range(0, max(lengths), chunk):
        live = [b for b, length in enumerate(lengths) if start < length]
        pieces = [sequences[b][start:start + chunk] for b in live]
        cu_seqlens = torch.tensor([0] + [len(p) for p in pieces]).cumsum(0)
        step_states = {name: tensor[live] for name, tensor in states.items()}
        packed = ZAYA_CCA.forward(module, torch.cat(pieces), cu_seqlens, torch.tensor([start > 0] * len(live)),
                                  step_states)
        for name, tensor in states.items():
            tensor[live] = step_states[name]
        for index, b in enumerate(live):
            outputs[b].append(packed[cu_seqlens[index]:cu_seqlens[index + 1]])
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(torch.cat(got), want, rtol=1e-12, atol=1e-12)
