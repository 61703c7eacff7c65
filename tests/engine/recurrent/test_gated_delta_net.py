"""The gated delta-net and short-convolution kinds against their Hugging Face modules
(float64, random weights): sequences of several lengths packed in one call, cut into
chunks across calls (single-token continuations beside longer chunks in one call),
and decoded token by token give the module's output on each sequence alone."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from shardline.engine.kernels.cpu_recurrent import recurrent_kernel_available
from shardline.engine.recurrent.gated_delta_net import GATED_DELTA_NET, GatedDeltaNetKind
from shardline.engine.recurrent.short_conv import SHORT_CONV, ShortConvKind

from .mixer_parity import chunked, make_sequences, prefill_then_decode, randomize, run_schedule, whole

LENGTHS = [9, 1, 70, 3, 6]  # 70: more than one 64-token chunk
HIDDEN = 32
_GDN = dict(hidden_size=HIDDEN, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"])
MODULES = {
    "qwen3_next": (lambda: Qwen3NextGatedDeltaNet(transformers.Qwen3NextConfig(**_GDN), 0), GATED_DELTA_NET),
    "qwen3_5": (lambda: Qwen3_5GatedDeltaNet(transformers.Qwen3_5TextConfig(**_GDN), 0), GATED_DELTA_NET),
    # The same layers with the recurrent core through the CPU kernel (kernels/cpu_recurrent.py).
    "qwen3_next-kernel": (lambda: Qwen3NextGatedDeltaNet(transformers.Qwen3NextConfig(**_GDN), 0),
                          GatedDeltaNetKind(native_core=True)),
    "qwen3_5-kernel": (lambda: Qwen3_5GatedDeltaNet(transformers.Qwen3_5TextConfig(**_GDN), 0),
                       GatedDeltaNetKind(native_core=True)),
    "lfm2": (lambda: Lfm2ShortConv(transformers.Lfm2Config(hidden_size=HIDDEN, num_hidden_layers=1,
                                                           layer_types=["conv"], conv_bias=True), 0), SHORT_CONV),
}
MODULES["lfm2-kernel"] = (MODULES["lfm2"][0], ShortConvKind(native_core=True))  # the convolution in C
SCHEDULES = {"whole": whole(LENGTHS), "chunked": chunked(LENGTHS, seed=2, max_chunk=37),
             "decode": prefill_then_decode(LENGTHS, 4)}


# The chunked schedule (packed, continued, single-token continuations beside chunks)
# for every module by default; the others slow-marked.
CASES = [pytest.param(name, schedule, id=f"{name}-{schedule}",
                      marks=() if schedule == "chunked" else pytest.mark.slow)
         for name in sorted(MODULES) for schedule in sorted(SCHEDULES)]


@pytest.mark.parametrize("name,schedule", CASES)
def test_kind_matches_the_hf_module(name, schedule):
    build, kind = MODULES[name]
    if name.endswith("-kernel") and not recurrent_kernel_available(torch.float64, 8, 8):
        pytest.skip("the recurrent kernel cannot be built here")
    module = randomize(build(), seed=0)
    sequences = make_sequences(LENGTHS, HIDDEN, seed=1)
    with torch.no_grad():
        expected = [module(sequence[None])[0] for sequence in sequences]
    outputs, _ = run_schedule(kind, module, None, sequences, SCHEDULES[schedule])
    # transformers runs the delta rule in float32; the kind in float64 here.
    tolerance = 1e-5 if isinstance(kind, GatedDeltaNetKind) else 1e-10
    for index, (got, want) in enumerate(zip(outputs, expected)):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance, msg=f"sequence {index}")
