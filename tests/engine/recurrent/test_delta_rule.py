"""The packed, chunked gated delta rule and the varlen causal convolution against
their token-by-token references, over requests of several lengths, some continuing
a saved state, for chunk sizes that cut requests anywhere."""

import pytest
import torch

from shardline.engine.kernels.recurrent_reference import (
    causal_conv1d_reference,
    gated_delta_rule_reference,
    l2_normalize,
)
from shardline.engine.recurrent.conv_varlen import causal_conv1d_varlen
from shardline.engine.recurrent.delta_rule import chunk_gated_delta_rule_varlen

LENGTHS = [1, 7, 20, 3, 1]
HAS_STATE = [True, False, True, True, False]
DECODE = [1, 1, 1, 1, 1]  # one token per request: the decode path


def _packed(lengths, *shape, generator, scale=1.0):
    return torch.randn(sum(lengths), *shape, dtype=torch.float64, generator=generator) * scale


@pytest.mark.parametrize("lengths,chunk_size", [(LENGTHS, 1), (LENGTHS, 4), (LENGTHS, 64), (DECODE, 64)])
def test_chunked_delta_rule_matches_the_recurrence(lengths, chunk_size):
    gen = torch.Generator().manual_seed(0)
    heads, k_dim, v_dim = 3, 8, 5
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q = l2_normalize(_packed(lengths, heads, k_dim, generator=gen)) * k_dim ** -0.5
    k = l2_normalize(_packed(lengths, heads, k_dim, generator=gen))
    v = _packed(lengths, heads, v_dim, generator=gen)
    g = -torch.rand(sum(lengths), heads, dtype=torch.float64, generator=gen)
    beta = torch.rand(sum(lengths), heads, dtype=torch.float64, generator=gen)
    saved = torch.randn(len(lengths), heads, k_dim, v_dim, dtype=torch.float64, generator=gen)
    initial = saved * torch.tensor(HAS_STATE, dtype=torch.float64)[:, None, None, None]
    out, final = chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, initial.clone(), chunk_size=chunk_size)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        expected, expected_state = gated_delta_rule_reference(q[start:end], k[start:end], v[start:end],
                                                              g[start:end], beta[start:end],
                                                              saved[b] if HAS_STATE[b] else None)
        torch.testing.assert_close(out[start:end], expected, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final[b], expected_state, rtol=1e-10, atol=1e-10)


def test_a_request_split_into_steps_gives_the_same_output_and_state():
    gen = torch.Generator().manual_seed(1)
    heads, k_dim, v_dim, length = 2, 4, 4, 30
    q, k = (l2_normalize(torch.randn(length, heads, k_dim, dtype=torch.float64, generator=gen)) for _ in range(2))
    v = torch.randn(length, heads, v_dim, dtype=torch.float64, generator=gen)
    g = -torch.rand(length, heads, dtype=torch.float64, generator=gen)
    beta = torch.rand(length, heads, dtype=torch.float64, generator=gen)
    whole, whole_state = chunk_gated_delta_rule_varlen(q, k, v, g, beta, torch.tensor([0, length]),
                                                       torch.zeros(1, heads, k_dim, v_dim, dtype=torch.float64))
    state = torch.zeros(1, heads, k_dim, v_dim, dtype=torch.float64)
    parts = []
    for start, end in [(0, 11), (11, 12), (12, 30)]:
        part, state = chunk_gated_delta_rule_varlen(q[start:end], k[start:end], v[start:end], g[start:end],
                                                    beta[start:end], torch.tensor([0, end - start]), state,
                                                    chunk_size=8)
        parts.append(part)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, whole_state, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("width,activation,bias,lengths", [(4, "silu", False, LENGTHS), (3, None, True, LENGTHS),
                                                           (1, None, True, LENGTHS), (4, "silu", True, DECODE)])
def test_varlen_causal_conv_matches_the_reference(width, activation, bias, lengths):
    gen = torch.Generator().manual_seed(2)
    channels = 6
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = _packed(lengths, channels, generator=gen)
    weight = torch.randn(channels, width, dtype=torch.float64, generator=gen)
    bias_t = torch.randn(channels, dtype=torch.float64, generator=gen) if bias else None
    saved = torch.randn(len(lengths), width - 1, channels, dtype=torch.float64, generator=gen)
    state = saved.clone()
    out = causal_conv1d_varlen(x, weight, bias_t, cu, torch.tensor(HAS_STATE), state, activation)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        expected, expected_state = causal_conv1d_reference(x[start:end], weight, bias_t,
                                                           saved[b] if HAS_STATE[b] else None, activation)
        torch.testing.assert_close(out[start:end], expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state[b], expected_state, rtol=0, atol=0)
