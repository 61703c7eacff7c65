"""The Triton selective scan (interpreted on CPU) against the plain-torch Mamba-1 scan
and, as Mamba-2's decode update, against ssd_decode_step:
requests of several lengths packed in one launch, some continuing a saved state
(a single token among them, as in decode), grouped B and C, with and without D and z;
states of requests that start fresh hold NaN, so reading one shows."""

import pytest
import torch

from shardline.engine.kernels._triton import triton_available
from shardline.engine.kernels.selective_scan import selective_scan_packed, ssd_decode_packed
from shardline.engine.recurrent.selective_scan import selective_scan_varlen
from shardline.engine.recurrent.ssd import ssd_decode_step

from .conftest import DEVICE

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def make_case(lengths, has_state, channels, groups, state_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    x, z = (torch.randn(total, channels, generator=gen).to(dtype) for _ in range(2))
    dt = torch.rand(total, channels, generator=gen)
    A = -torch.rand(channels, state_size, generator=gen) * 2
    B, C = (torch.randn(total, groups, state_size, generator=gen).to(dtype) for _ in range(2))
    D = torch.randn(channels, generator=gen)
    state = torch.randn(len(lengths), channels, state_size, generator=gen)
    state[~torch.tensor(has_state)] = float("nan")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return [t.to(DEVICE) for t in (x, dt, A, B, C, D, z, cu, torch.tensor(has_state), state)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("with_d_and_z", [True, False])
def test_triton_selective_scan_matches_the_torch_scan(dtype, tol, with_d_and_z):
    lengths, has_state = [5, 1, 19, 2, 1], [True, True, False, False, False]
    x, dt, A, B, C, D, z, cu, has_initial, state = make_case(lengths, has_state, 40, 4, 6, dtype)
    if not with_d_and_z:
        D = z = None
    initial = torch.where(has_initial[:, None, None], state, 0.0)
    expected, expected_state = selective_scan_varlen(
        x.float(), dt, A, B.float(), C.float(), D, None if z is None else z.float(), cu, initial
    )
    kernel_state = state.clone()
    y = selective_scan_packed(x, dt, A, B, C, D, z, cu, has_initial, kernel_state, block_d=16)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(kernel_state, expected_state, rtol=1e-5, atol=1e-5)


def test_mamba2_decode_through_the_kernel_matches_the_torch_update():
    gen = torch.Generator().manual_seed(1)
    requests, heads, head_dim, groups, state_size = 3, 4, 8, 2, 16
    x = torch.randn(requests, heads, head_dim, generator=gen)
    dt = torch.rand(requests, heads, generator=gen)
    A = -torch.rand(heads, generator=gen) * 2
    B, C = (torch.randn(requests, groups, state_size, generator=gen) for _ in range(2))
    D = torch.randn(heads, generator=gen)
    state = torch.randn(requests, heads, head_dim, state_size, generator=gen)
    x, dt, A, B, C, D, state = (t.to(DEVICE) for t in (x, dt, A, B, C, D, state))
    expected_state = state.clone()
    expected = ssd_decode_step(expected_state, x, dt, A, B, C, D)
    y = ssd_decode_packed(state, x, dt, A, B, C, D)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)
