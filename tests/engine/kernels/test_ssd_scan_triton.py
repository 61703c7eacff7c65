"""The Triton chunked SSD scan (interpreted on CPU) against Mamba-2's recurrence (the
single-token update, token by token) and the torch chunked scan: requests of several
lengths packed in one launch (one shorter than a chunk, one over two chunks, a single
token), some continuing a saved state, grouped B and C, with and without D, float32
and bfloat16 inputs, and lightning attention's shape (dt = 1, one group per head),
its decode step too (through the selective-scan kernel)."""

import pytest
import torch

from shardline.engine.kernels._triton import triton_available
from shardline.engine.kernels.selective_scan import ssd_decode_packed
from shardline.engine.kernels.ssd_scan import ssd_chunk_scan_triton
from shardline.engine.recurrent.ssd import ssd_chunk_scan_varlen, ssd_decode_step

from .conftest import DEVICE

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

LENGTHS = [5, 37, 1, 16]
HAS_STATE = [True, False, True, False]


def make_case(lengths, has_state, heads, head_dim, groups, state_size, seed=0):
    """x, dt > 0, A < 0, B, C, D and initial states (zero where not has_state); float32, on CPU."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    x = torch.randn(total, heads, head_dim, generator=gen)
    dt = torch.rand(total, heads, generator=gen) * 0.5
    A = -torch.rand(heads, generator=gen) * 2
    B, C = (torch.randn(total, groups, state_size, generator=gen) for _ in range(2))
    D = torch.randn(heads, generator=gen)
    saved = torch.randn(len(lengths), heads, head_dim, state_size, generator=gen)
    initial = saved * torch.tensor(has_state, dtype=saved.dtype)[:, None, None, None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return x, dt, A, B, C, D, initial, cu


def run_kernel(x, dt, A, B, C, D, initial, cu, dtype=torch.float32, chunk=16, block_p=32):
    x, dt, B, C = (t.to(DEVICE, dtype) for t in (x, dt, B, C))
    initial_on_device = initial.to(DEVICE)
    y, final = ssd_chunk_scan_triton(x, dt, A.to(DEVICE), B, C, None if D is None else D.to(DEVICE),
                                     cu.to(DEVICE), initial_on_device, chunk=chunk, block_p=block_p)
    torch.testing.assert_close(initial_on_device.cpu(), initial, rtol=0, atol=0)  # the input state is kept
    return y.cpu(), final.cpu()


def recurrence(x, dt, A, B, C, D, initial, cu):
    """Each request token by token through the single-token update, in float64."""
    x, dt, A, B, C, initial = (t.double() for t in (x, dt, A, B, C, initial))
    D = None if D is None else D.double()
    outputs, finals = [], []
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        state = initial[b : b + 1].clone()
        for t in range(start, end):
            outputs.append(ssd_decode_step(state, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D,
                                           decay_dtype=torch.float64))
        finals.append(state)
    return torch.cat(outputs).float(), torch.cat(finals).float()


@pytest.mark.parametrize("has_state,with_d", [(HAS_STATE, True), ([False] * 4, False)])
def test_triton_ssd_scan_matches_the_recurrence(has_state, with_d):
    # head_dim 40: three 16-wide channel blocks; 4 heads in 2 groups
    x, dt, A, B, C, D, initial, cu = make_case(LENGTHS, has_state, 4, 40, 2, 16)
    D = D if with_d else None
    y, final = run_kernel(x, dt, A, B, C, D, initial, cu, block_p=16)
    expected, expected_state = recurrence(x, dt, A, B, C, D, initial, cu)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, expected_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_triton_ssd_scan_matches_the_torch_chunked_scan(dtype, tol):
    x, dt, A, B, C, D, initial, cu = make_case(LENGTHS, HAS_STATE, 2, 16, 1, 24, seed=1)  # N not a power of 2
    x, dt, B, C = (t.to(dtype).float() for t in (x, dt, B, C))  # the values the kernel reads
    y, final = run_kernel(x, dt, A, B, C, D, initial, cu, dtype=dtype)
    expected, expected_state = ssd_chunk_scan_varlen(x, dt, A, B, C, D, 16, cu, initial)
    torch.testing.assert_close(y, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(final, expected_state, rtol=tol, atol=tol)


def test_triton_ssd_scan_runs_lightning_attention():
    # linear_attention.py's call: x = v, B = k, C = q, dt = 1, A = -slope, one group per head
    heads, head_dim = 2, 16
    x, _, _, B, C, _, initial, cu = make_case(LENGTHS, HAS_STATE, heads, head_dim, heads, head_dim, seed=2)
    dt = torch.ones(x.shape[:2])
    A = -torch.tensor([0.5, 0.0625])
    y, final = run_kernel(x, dt, A, B, C, None, initial, cu)
    expected, expected_state = recurrence(x, dt, A, B, C, None, initial, cu)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, expected_state, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_triton_ssd_scan_sweep_of_chunks_and_lengths(chunk):
    lengths = [1, 15, 16, 17, 63, 64, 65, 130]
    x, dt, A, B, C, D, initial, cu = make_case(lengths, [b % 2 == 0 for b in range(len(lengths))], 4, 32, 2, 32,
                                               seed=3)
    y, final = run_kernel(x, dt, A, B, C, D, initial, cu, chunk=chunk)
    expected, expected_state = ssd_chunk_scan_varlen(x.double(), dt.double(), A.double(), B.double(), C.double(),
                                                     D.double(), 64, cu, initial.double(),
                                                     compute_dtype=torch.float64)
    torch.testing.assert_close(y, expected.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, expected_state.float(), rtol=1e-4, atol=1e-4)


def test_lightning_attention_decode_through_the_selective_scan_kernel():
    # linear_attention.py's decode on CUDA: q, k, v sliced from one qkv row, dt = 1, A = -slope
    gen = torch.Generator().manual_seed(4)
    requests, heads, head_dim = 3, 2, 16
    qkv = torch.randn(requests, heads, 3 * head_dim, generator=gen)
    q, k, v = qkv.split(head_dim, dim=-1)
    dt = torch.ones(requests, heads)
    A = -torch.tensor([0.5, 0.0625])
    state = torch.randn(requests, heads, head_dim, head_dim, generator=gen)
    expected_state = state.clone()
    expected = ssd_decode_step(expected_state, v, dt, A, k, q, None)
    kernel_state = state.to(DEVICE)
    y = ssd_decode_packed(kernel_state, *(t.to(DEVICE) for t in (v, dt, A, k, q)), None)
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel_state.cpu(), expected_state, rtol=1e-5, atol=1e-5)
