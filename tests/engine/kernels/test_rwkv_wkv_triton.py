"""The Triton WKV scan (interpreted on CPU) against the plain-torch scan
(kernels/rwkv_wkv.py's wkv_varlen): requests with and without saved states, prefill
chunks beside single decode tokens, a width over several blocks that is not a power of
two, float32 and bfloat16 inputs, several steps in a row."""

import pytest
import torch

from shardline.engine.kernels._triton import triton_available
from shardline.engine.kernels.rwkv_wkv import wkv_varlen
from shardline.engine.kernels.rwkv_wkv_triton import wkv_varlen_triton

from .conftest import DEVICE

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_wkv_scan_matches_the_torch_scan(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    width = 40
    time_decay, first = torch.randn(width, generator=gen), torch.randn(width, generator=gen)
    states = [torch.full((4, width), float("nan")) for _ in range(3)]  # no request has a state yet
    expected_states = [state.clone() for state in states]
    kernel_states = [state.to(DEVICE) for state in states]
    for lengths, has_state in (([5, 1, 7, 2], [False] * 4), ([1, 1, 3, 1], [True] * 4), ([1, 4, 1, 1], [True] * 4)):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        key = (torch.randn(sum(lengths), width, generator=gen) * 3).to(dtype)
        value = torch.randn(sum(lengths), width, generator=gen).to(dtype)
        flags = torch.tensor(has_state)
        expected = wkv_varlen(time_decay, first, key, value, cu, flags, *expected_states)
        decay = -torch.exp(time_decay)
        out = wkv_varlen_triton(decay.to(DEVICE), first.to(DEVICE), key.to(DEVICE), value.to(DEVICE), cu.to(DEVICE),
                                flags.to(DEVICE), *kernel_states, block=16)
        assert out.dtype == dtype
        torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=tol, atol=tol)
        for got, want in zip(kernel_states, expected_states):
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
