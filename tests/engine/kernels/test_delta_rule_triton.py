"""The Triton chunked gated delta rule (interpreted on CPU) against the token-by-token
recurrence, the torch chunked rule and transformers' own torch_chunk_gated_delta_rule:
requests of several lengths packed in one launch (one shorter than a chunk, one over
two chunks, a single token), some continuing a saved state, float32 and bfloat16,
value heads wider than one value block."""

import pytest
import torch

from shardline.engine.kernels._triton import triton_available
from shardline.engine.kernels.delta_rule import chunk_gated_delta_rule_triton
from shardline.engine.kernels.recurrent_reference import gated_delta_rule_reference, l2_normalize
from shardline.engine.recurrent.delta_rule import chunk_gated_delta_rule_varlen

from .conftest import DEVICE

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

LENGTHS = [5, 37, 1, 16]
HAS_STATE = [True, False, True, False]


def make_case(lengths, heads, key_dim, value_dim, seed=0):
    """Raw (unnormalised) q and k, v, g <= 0, beta in (0, 1), saved states; float32, on CPU."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, heads, key_dim, generator=gen) for _ in range(2))
    v = torch.randn(total, heads, value_dim, generator=gen)
    g = -torch.rand(total, heads, generator=gen)
    beta = torch.rand(total, heads, generator=gen)
    saved = torch.randn(len(lengths), heads, key_dim, value_dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, g, beta, saved, cu


def initial_states(saved, has_state):
    return saved * torch.tensor(has_state, dtype=saved.dtype)[:, None, None, None]


def run_kernel(q, k, v, g, beta, cu, initial, dtype, chunk=16, block_v=64, strided=False):
    moved = [t.to(DEVICE, dtype) for t in (q, k, v, g, beta)]
    if strided:  # v a slice of wider rows (as split from q|k|v), g head-major
        num_tokens, heads, value_dim = v.shape
        rows = torch.zeros(num_tokens, 3 + heads * value_dim, dtype=dtype, device=DEVICE)
        rows[:, 3:] = moved[2].reshape(num_tokens, -1)
        moved[2] = rows[:, 3:].view(num_tokens, heads, value_dim)
        moved[3] = moved[3].t().contiguous().t()
    state = initial.to(DEVICE).clone()
    out, state = chunk_gated_delta_rule_triton(*moved, cu.to(DEVICE), state, chunk=chunk, block_v=block_v)
    assert out.dtype == dtype
    return out.float().cpu(), state.cpu()


@pytest.mark.parametrize("has_state", [HAS_STATE, [False] * 4])
def test_triton_delta_rule_matches_the_recurrence(has_state):
    heads, key_dim, value_dim = 2, 16, 40  # 40 value columns: three 16-wide value blocks
    q, k, v, g, beta, saved, cu = make_case(LENGTHS, heads, key_dim, value_dim)
    q, k = l2_normalize(q) * key_dim ** -0.5, l2_normalize(k)
    initial = initial_states(saved, has_state)
    out, final = run_kernel(q, k, v, g, beta, cu, initial, torch.float32, block_v=16, strided=True)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        expected, expected_state = gated_delta_rule_reference(
            *(t[start:end].double() for t in (q, k, v, g, beta)), initial[b].double())
        torch.testing.assert_close(out[start:end], expected.float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final[b], expected_state.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2),
                                       pytest.param(torch.float32, 1e-4, marks=pytest.mark.slow)])
def test_triton_delta_rule_matches_the_torch_chunked_rule(dtype, tol):
    heads, key_dim, value_dim = 3, 24, 16  # a key width that is not a power of two
    q, k, v, g, beta, saved, cu = make_case(LENGTHS, heads, key_dim, value_dim, seed=1)
    q, k = l2_normalize(q) * key_dim ** -0.5, l2_normalize(k)
    q, k, v, g, beta = (t.to(dtype).float() for t in (q, k, v, g, beta))  # the values the kernel reads
    initial = initial_states(saved, HAS_STATE)
    out, final = run_kernel(q, k, v, g, beta, cu, initial, dtype)
    expected, expected_state = chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, initial.clone(), chunk_size=16)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(final, expected_state, rtol=tol, atol=tol)


def test_triton_delta_rule_matches_transformers_chunked_rule():
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    heads, key_dim, value_dim = 2, 16, 16
    q, k, v, g, beta, saved, cu = make_case(LENGTHS, heads, key_dim, value_dim, seed=2)
    initial = initial_states(saved, HAS_STATE)
    # transformers normalises q and k and scales q itself (use_qk_l2norm_in_kernel).
    out, final = run_kernel(l2_normalize(q) * key_dim ** -0.5, l2_normalize(k), v, g, beta, cu, initial,
                            torch.float32)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        expected, expected_state = modeling.torch_chunk_gated_delta_rule(
            *(t[start:end][None] for t in (q, k, v, g, beta)), chunk_size=16,
            initial_state=initial[b][None] if HAS_STATE[b] else None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[start:end], expected[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final[b], expected_state[0], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_triton_delta_rule_sweep_of_chunks_and_lengths(chunk):
    lengths = [1, 15, 16, 17, 63, 64, 65, 130]
    heads, key_dim, value_dim = 2, 32, 48
    q, k, v, g, beta, saved, cu = make_case(lengths, heads, key_dim, value_dim, seed=3)
    q, k = l2_normalize(q) * key_dim ** -0.5, l2_normalize(k)
    initial = initial_states(saved, [b % 2 == 0 for b in range(len(lengths))])
    out, final = run_kernel(q, k, v, g, beta, cu, initial, torch.float32, chunk=chunk)
    expected, expected_state = chunk_gated_delta_rule_varlen(*(t.double() for t in (q, k, v, g, beta)), cu,
                                                             initial.double().clone())
    torch.testing.assert_close(out, expected.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, expected_state.float(), rtol=1e-4, atol=1e-4)
