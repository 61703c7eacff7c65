"""The Triton absorbed latent-attention decode (interpreted on CPU, compiled on CUDA)
against the plain-torch reference: head counts past one program's and not a multiple
of it, DeepSeek-V3's 512 + 64 latent row, a rank and rotary part that are not powers
of two, lengths of one token, a page and many pages; slots no request owns hold NaN."""

import pytest
import torch

from shardline.engine.kernels._triton import triton_available
from shardline.engine.kernels.mla_decode import mla_decode_reference, mla_decode_triton

from .conftest import DEVICE
from .test_cpu_mla import make_latent_batch

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,rank,rope,block_size", [(4, 24, 8, 8), (20, 40, 12, 16), (16, 512, 64, 64)])
def test_triton_mla_decode_matches_the_reference(dtype, tol, num_heads, rank, rope, block_size):
    q_abs, cache, tables, seq_lens = make_latent_batch([1, block_size, 13, 3 * block_size + 5], num_heads, rank,
                                                       rope, block_size, dtype)
    out = mla_decode_triton(q_abs.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE), seq_lens.to(DEVICE), rank, 0.2)
    assert out.dtype == dtype
    expected = mla_decode_reference(q_abs.float(), cache.float(), tables, seq_lens, rank, 0.2)
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tol, atol=tol)


def test_the_launcher_refuses_a_cache_of_another_layout():
    q_abs, cache, tables, seq_lens = make_latent_batch([5], 4, 24, 8, 8, torch.float32)
    with pytest.raises(AssertionError):
        mla_decode_triton(q_abs, cache[:, :, :30], tables, seq_lens, 24, 0.2)  # a row narrower than the query
    with pytest.raises(TypeError, match="float64"):
        mla_decode_triton(q_abs.double(), cache.double(), tables, seq_lens, 24, 0.2)


def test_a_row_of_context_zero_gets_zeros_beside_the_others():
    """A CUDA decode graph's padding row (context 0) attends nothing: zeros, not NaN,
    and the real rows beside it are unchanged."""
    q_abs, cache, tables, seq_lens = make_latent_batch([9, 1, 20], 20, 24, 8, 8, torch.float32)
    seq_lens[1] = 0
    out = mla_decode_triton(q_abs.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE), seq_lens.to(DEVICE), 24, 0.2)
    assert torch.equal(out[1].cpu(), torch.zeros(20, 24))
    expected = mla_decode_reference(q_abs[[0, 2]], cache, tables[[0, 2]], seq_lens[[0, 2]], 24, 0.2)
    torch.testing.assert_close(out[[0, 2]].cpu(), expected, rtol=1e-5, atol=1e-5)
