"""The Triton varlen causal convolution against its plain-torch reference, per
request (on CPU through Triton's interpreter): requests of several lengths, some
continuing a saved window, with and without bias and SiLU."""

import pytest
import torch

from shardline.engine.kernels._triton import triton_available
from shardline.engine.kernels.causal_conv1d import causal_conv1d_varlen_triton
from shardline.engine.kernels.recurrent_reference import causal_conv1d_reference

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

LENGTHS = [1, 7, 20, 3, 1]
HAS_STATE = [True, False, True, True, False]


@pytest.mark.parametrize("width,activation,bias", [(4, "silu", False), (3, None, True)])
def test_triton_conv_matches_the_reference(width, activation, bias):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    channels = 70  # crosses a channel block
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    x = torch.randn(sum(LENGTHS), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    bias_t = torch.randn(channels, generator=gen) if bias else None
    state = torch.randn(len(LENGTHS), width - 1, channels, generator=gen)
    moved = [t.to(device) if t is not None else None for t in (x, weight, bias_t, cu, state)]
    out = causal_conv1d_varlen_triton(moved[0], moved[1], moved[2], moved[3], torch.tensor(HAS_STATE, device=device),
                                      moved[4], activation).cpu()
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        expected, _ = causal_conv1d_reference(x[start:end], weight, bias_t, state[b] if HAS_STATE[b] else None,
                                              activation)
        torch.testing.assert_close(out[start:end], expected, rtol=1e-5, atol=1e-5)
