"""The C WKV scan (cpu_rwkv.c) against the plain-torch scan (rwkv_wkv.py's
wkv_varlen): requests with and without saved states (the unset ones NaN, so a stray
read shows), prefill chunks beside decode tokens, a width over several blocks that is
not a multiple of one, strided key rows, several steps in a row."""

import pytest
import torch

from shardline.engine.kernels.cpu_rwkv import rwkv_kernel_available, wkv_varlen_cpu
from shardline.engine.kernels.rwkv_wkv import wkv_varlen

pytestmark = pytest.mark.skipif(not rwkv_kernel_available(), reason="cpu_rwkv.c does not build here")


def test_c_wkv_scan_matches_the_torch_scan():
    gen = torch.Generator().manual_seed(0)
    width = 100
    time_decay, first = torch.randn(width, generator=gen), torch.randn(width, generator=gen)
    states = [torch.full((4, width), float("nan")) for _ in range(3)]
    expected_states = [state.clone() for state in states]
    for lengths, has_state in (([5, 1, 7, 2], [False] * 4), ([1, 1, 3, 1], [True] * 4), ([1, 4, 1, 1], [True] * 4)):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        keys_and_values = torch.randn(sum(lengths), 2 * width, generator=gen)
        key, value = keys_and_values[:, :width] * 3, keys_and_values[:, width:]  # value rows strided
        flags = torch.tensor(has_state)
        expected = wkv_varlen(time_decay, first, key, value, cu, flags, *expected_states)
        out = wkv_varlen_cpu(-torch.exp(time_decay), first, key, value, cu, flags, *states)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for got, want in zip(states, expected_states):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
