"""The CPU absorbed latent-attention decode (C, through ctypes) against its plain-torch
reference, built for each target in turn; cache slots no request owns hold NaN."""

import shutil

import pytest
import torch

from shardline.engine.kernels.cpu_mla import mla_decode, mla_decode_available, mla_decode_reference

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine uses its torch path")
each_target = pytest.mark.usefixtures("kernel_target")

TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2}  # atol and rtol


def make_latent_batch(seq_lens: list[int], num_heads: int, rank: int, rope: int, block_size: int,
                      dtype: torch.dtype, seed: int = 0):
    """Absorbed queries [n, H, r + dr], a paged latent cache whose blocks each request
    owns in shuffled order (every other slot NaN), block tables and lengths."""
    generator = torch.Generator().manual_seed(seed)
    width = rank + rope
    tables = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(tables) + 3
    cache = torch.full((num_blocks, block_size, width), float("nan"), dtype=torch.float64)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros((len(seq_lens), max(tables)), dtype=torch.int32)
    for request, length in enumerate(seq_lens):
        blocks = [order.pop() for _ in range(tables[request])]
        block_tables[request, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        rows = torch.randn(length, width, generator=generator, dtype=torch.float64)
        for position in range(length):
            cache[blocks[position // block_size], position % block_size] = rows[position]
    q_abs = torch.randn(len(seq_lens), num_heads, width, generator=generator, dtype=torch.float64) * 2
    return q_abs.to(dtype), cache.to(dtype), block_tables, torch.tensor(seq_lens, dtype=torch.int64)


@each_target
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("num_heads,rank,rope,block_size", [(4, 24, 16, 8), (20, 32, 8, 16), (16, 512, 64, 64)])
def test_kernel_matches_reference(dtype, num_heads, rank, rope, block_size):
    """Small heads, a head count past one run of heads (20 > 16), DeepSeek-V3's latent
    (512 + 64); lengths of one token, a block exactly, mid-block and many blocks."""
    q_abs, cache, tables, seq_lens = make_latent_batch([1, block_size, 13, 3 * block_size + 5], num_heads, rank,
                                                       rope, block_size, dtype)
    assert mla_decode_available(cache)
    out = mla_decode(q_abs, cache, tables, seq_lens, rank, 0.2)
    if dtype == torch.bfloat16:  # the exact answer for the stored bfloat16 values
        expected = mla_decode_reference(q_abs.float(), cache.float(), tables, seq_lens, rank, 0.2).to(dtype)
    else:
        expected = mla_decode_reference(q_abs, cache, tables, seq_lens, rank, 0.2)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@each_target
def test_threads_split_heads_into_runs(monkeypatch):
    """One request over four threads: its heads split into several items, same answer."""
    q_abs, cache, tables, seq_lens = make_latent_batch([37], 16, 24, 8, 16, torch.float64, seed=3)
    expected = mla_decode_reference(q_abs, cache, tables, seq_lens, 24, 0.3)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        out = mla_decode(q_abs, cache, tables, seq_lens, 24, 0.3)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)


def test_a_latent_row_wider_than_the_kernel_is_left_to_torch():
    assert not mla_decode_available(torch.zeros(2, 8, 2048))
    assert not mla_decode_available(torch.zeros(2, 8, 40, dtype=torch.float16))
