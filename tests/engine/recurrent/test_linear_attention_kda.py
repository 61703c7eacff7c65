"""The Kimi delta attention kind against Hugging Face's KimiLinearDeltaAttention and
BailingHybridDeltaAttention (float64 modules, random weights; the rule itself runs in
float32 there and here): packed, chunked and decode schedules give the module's
output on each sequence alone, and its final conv window and recurrent state; the
chunked rule equals its token-by-token recurrence from saved states."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from shardline.engine.recurrent.kda import KIMI_DELTA, chunk_kda_varlen, kda_decode_step

from .mixer_parity import chunked, hf_reference, make_sequences, prefill_then_decode, randomize, run_schedule, whole

LENGTHS = [9, 1, 40, 3, 6]
HIDDEN = 16
CONFIGS = {
    "kimi_linear": lambda: transformers.KimiLinearConfig(
        hidden_size=HIDDEN, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
    ),
    "bailing_hybrid": lambda: transformers.BailingHybridConfig(
        hidden_size=HIDDEN, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
    ),
}
LAYERS = {"kimi_linear": "KimiLinearDeltaAttention", "bailing_hybrid": "BailingHybridDeltaAttention"}


@pytest.fixture(scope="module", params=list(CONFIGS))
def kda_case(request):
    config = CONFIGS[request.param]()
    modeling = getattr(getattr(transformers.models, request.param), f"modeling_{request.param}")
    layer = randomize(getattr(modeling, LAYERS[request.param])(config, layer_idx=0), seed=0)
    sequences = make_sequences(LENGTHS, HIDDEN, seed=1)
    references = [hf_reference(layer, config, s, layer_idx=0) for s in sequences]
    return layer, config, sequences, references


@pytest.mark.parametrize(
    "schedule", [whole(LENGTHS), chunked(LENGTHS, seed=2, max_chunk=19), prefill_then_decode(LENGTHS, 4)],
    ids=["whole", "chunked", "decode"],
)
def test_kda_kind_matches_the_hf_layer(kda_case, schedule):
    layer, config, sequences, references = kda_case
    outputs, states = run_schedule(KIMI_DELTA, layer, config, sequences, schedule)
    for i, (expected, cache) in enumerate(references):
        cache_layer = cache.layers[0]
        expected_states = {
            "conv": cache_layer.conv_states[0][0, :, 1:].t(),
            "recurrent": cache_layer.recurrent_states[0][0],
        }
        torch.testing.assert_close(outputs[i], expected, rtol=1e-5, atol=1e-5, msg=f"sequence {i} output")
        for name, value in expected_states.items():
            torch.testing.assert_close(states[i][name], value.to(states[i][name].dtype), rtol=1e-5, atol=1e-5,
                                       msg=f"sequence {i} state {name}")


@pytest.mark.parametrize("chunk_size", [1, 4, 16])
def test_chunked_kda_matches_the_recurrence_from_saved_states(chunk_size):
    gen = torch.Generator().manual_seed(3)
    lengths, has_state = [5, 1, 11, 2], [True, False, True, False]
    heads, k_dim, v_dim = 2, 4, 3
    total = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = torch.nn.functional.normalize(rand(total, heads, k_dim), dim=-1) * k_dim**-0.5
    k = torch.nn.functional.normalize(rand(total, heads, k_dim), dim=-1)
    v = rand(total, heads, v_dim)
    g = -torch.rand(total, heads, k_dim, generator=gen, dtype=torch.float64)
    beta = torch.rand(total, heads, generator=gen, dtype=torch.float64)
    state_mask = torch.tensor(has_state, dtype=torch.float64)[:, None, None, None]
    initial = rand(len(lengths), heads, k_dim, v_dim) * state_mask
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out, final = chunk_kda_varlen(q, k, v, g, beta, cu, initial, chunk_size=chunk_size)
    for b in range(len(lengths)):
        state = initial[b : b + 1].clone()
        for t in range(int(cu[b]), int(cu[b + 1])):
            expected = kda_decode_step(state, q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1])
            torch.testing.assert_close(out[t], expected[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final[b], state[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "schedule", [chunked(LENGTHS, seed=2, max_chunk=19), prefill_then_decode(LENGTHS, 4)], ids=["chunked", "decode"])
def test_kda_kind_through_the_cpu_kernel_matches_the_hf_layer(kda_case, schedule):
    """A float32 layer with the recurrent core through the CPU kernel
    (kernels/cpu_recurrent.py), which the kind takes there: the HF layer's outputs and
    states within float32 rounding."""
    from shardline.engine.kernels.cpu_recurrent import recurrent_kernel_available
    from shardline.engine.recurrent.kda import KimiDeltaAttentionKind

    layer, config, sequences, _ = kda_case
    if not recurrent_kernel_available(torch.float32, layer.head_dim, layer.head_dim):
        pytest.skip("the recurrent kernel cannot be built here")
    layer = copy.deepcopy(layer).float()
    sequences = [s.float() for s in sequences]
    kind = KimiDeltaAttentionKind(native_core=True)
    states = {name: torch.zeros((1, *shape), dtype=dtype) for name, (shape, dtype) in
              kind.state_shapes(layer, config).items()}
    assert kind._takes_native_core(layer, torch.zeros(1, layer.conv_dim), states)
    outputs, final = run_schedule(kind, layer, config, sequences, schedule)
    for i, sequence in enumerate(sequences):
        expected, cache = hf_reference(layer, config, sequence, layer_idx=0)
        cache_layer = cache.layers[0]
        torch.testing.assert_close(outputs[i], expected, rtol=1e-4, atol=1e-4, msg=f"sequence {i} output")
        torch.testing.assert_close(final[i]["recurrent"], cache_layer.recurrent_states[0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final[i]["conv"], cache_layer.conv_states[0][0, :, 1:].t(), rtol=1e-5, atol=1e-5)
