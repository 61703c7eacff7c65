"""The Triton chunked Kimi delta attention (interpreted on CPU) against the recurrence
(the single-token update, token by token), the torch chunked rule and transformers'
own chunk_kimi_delta_attention: requests of several lengths packed in one launch (one
shorter than a chunk, one over two chunks, a single token), some continuing a saved
state, float32 and bfloat16, strong decays (a chunk's summed log-decay far below
float32's exponent range), value heads wider than one value block."""

import pytest
import torch

from shardline.engine.kernels._triton import triton_available
from shardline.engine.kernels.kda import chunk_kda_triton
from shardline.engine.kernels.recurrent_reference import kda_step_reference
from shardline.engine.recurrent.kda import chunk_kda_varlen, l2norm

from .conftest import DEVICE

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

LENGTHS = [5, 37, 1, 16]
HAS_STATE = [True, False, True, False]


def make_case(lengths, has_state, heads, key_dim, value_dim, seed=0, decay_scale=1.0):
    """Raw (unnormalised) q and k, v, g <= 0 per key channel, beta in (0, 1), initial
    states (zero where not has_state); float32, on CPU."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, heads, key_dim, generator=gen) for _ in range(2))
    v = torch.randn(total, heads, value_dim, generator=gen)
    g = -torch.rand(total, heads, key_dim, generator=gen) * decay_scale
    beta = torch.rand(total, heads, generator=gen)
    saved = torch.randn(len(lengths), heads, key_dim, value_dim, generator=gen)
    initial = saved * torch.tensor(has_state, dtype=saved.dtype)[:, None, None, None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, g, beta, initial, cu


def normalised(q, k):
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


def run_kernel(q, k, v, g, beta, initial, cu, dtype=torch.float32, chunk=16, block_v=64):
    moved = [t.to(DEVICE, dtype) for t in (q, k, v, g, beta)]
    initial_on_device = initial.to(DEVICE)
    out, final = chunk_kda_triton(*moved, cu.to(DEVICE), initial_on_device, chunk=chunk, block_v=block_v)
    assert out.dtype == dtype
    torch.testing.assert_close(initial_on_device.cpu(), initial, rtol=0, atol=0)  # the input state is kept
    return out.float().cpu(), final.cpu()


def recurrence(q, k, v, g, beta, initial, cu):
    """Each request token by token through the single-token update, in float64."""
    q, k, v, g, beta, initial = (t.double() for t in (q, k, v, g, beta, initial))
    outputs, finals = [], []
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        state = initial[b : b + 1].clone()
        for t in range(start, end):
            outputs.append(kda_step_reference(state, *(x[t : t + 1] for x in (q, k, v, g, beta))))
        finals.append(state)
    return torch.cat(outputs).float(), torch.cat(finals).float()


@pytest.mark.parametrize("has_state,key_dim,decay_scale", [(HAS_STATE, 24, 1.0), ([False] * 4, 16, 8.0)])
def test_triton_kda_matches_the_recurrence(has_state, key_dim, decay_scale):
    # key_dim 24: not a power of two; 40 value columns: three 16-wide value blocks.
    # decay_scale 8: a 16-token chunk sums log-decays near -64 per channel, -600 over 37 tokens
    q, k, v, g, beta, initial, cu = make_case(LENGTHS, has_state, 2, key_dim, 40, decay_scale=decay_scale)
    q, k = normalised(q, k)
    out, final = run_kernel(q, k, v, g, beta, initial, cu, block_v=16)
    expected, expected_state = recurrence(q, k, v, g, beta, initial, cu)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, expected_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2),
                                       pytest.param(torch.float32, 1e-4, marks=pytest.mark.slow)])
def test_triton_kda_matches_the_torch_chunked_rule(dtype, tol):
    q, k, v, g, beta, initial, cu = make_case(LENGTHS, HAS_STATE, 3, 24, 16, seed=1)
    q, k = normalised(q, k)
    q, k, v, g, beta = (t.to(dtype).float() for t in (q, k, v, g, beta))  # the values the kernel reads
    out, final = run_kernel(q, k, v, g, beta, initial, cu, dtype=dtype)
    expected, expected_state = chunk_kda_varlen(q, k, v, g, beta, cu, initial)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(final, expected_state, rtol=tol, atol=tol)


def test_triton_kda_matches_transformers_chunked_rule():
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    key_dim = 16
    q, k, v, g, beta, initial, cu = make_case(LENGTHS, HAS_STATE, 2, key_dim, 16, seed=2)
    out, final = run_kernel(*normalised(q, k), v, g, beta, initial, cu)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        # transformers normalises q and k and scales q itself (use_qk_l2norm_in_kernel)
        expected, expected_state = modeling.chunk_kimi_delta_attention(
            *(t[start:end][None] for t in (q, k, v, g, beta)), chunk_size=16,
            initial_state=initial[b][None] if HAS_STATE[b] else None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[start:end], expected[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final[b], expected_state[0], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_triton_kda_sweep_of_chunks_and_lengths(chunk):
    lengths = [1, 15, 16, 17, 63, 64, 65, 130]
    q, k, v, g, beta, initial, cu = make_case(lengths, [b % 2 == 0 for b in range(len(lengths))], 2, 32, 48,
                                              seed=3)
    q, k = normalised(q, k)
    out, final = run_kernel(q, k, v, g, beta, initial, cu, chunk=chunk)
    expected, expected_state = chunk_kda_varlen(*(t.double() for t in (q, k, v, g, beta)), cu, initial.double())
    torch.testing.assert_close(out, expected.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, expected_state.float(), rtol=1e-4, atol=1e-4)
