"""paged_attention (Triton, interpreted on CPU) against its plain-torch reference."""

import pytest
import torch
import torch.nn.functional as F

from shardline.engine.kernels import (
    paged_attention,
    paged_attention_reference,
    store_kv_cache,
    triton_available,
)

from .conftest import DEVICE, FEATURES, feature_options

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

# (context_lens, query_lens): cached tokens and new tokens per sequence.
DECODE = ([7, 33, 0, 64], [1, 1, 1, 1])
PREFILL_WITH_PREFIX = ([16, 40], [23, 9])
PREFILL_FRESH = ([0, 0], [19, 5])
MIXED = ([21, 0, 50, 3], [1, 18, 1, 12])


def assert_kernel_matches_reference(batch, atol=2e-5, rtol=1e-5, **options):
    scale = batch.q.shape[-1] ** -0.5
    out = paged_attention(*batch.args(), scale, **options)
    expected = paged_attention_reference(*batch.args(), scale, **options)
    assert out.dtype == batch.q.dtype and out.shape == (*batch.q.shape[:2], batch.v_cache.shape[3])
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@needs_triton
@pytest.mark.parametrize("queries_per_kv", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_matches_reference_across_shapes(paged_batch, head_dim, block_size, queries_per_kv):
    batch = paged_batch(*MIXED, num_heads=2 * queries_per_kv, num_kv_heads=2,
                        head_dim=head_dim, block_size=block_size)
    assert_kernel_matches_reference(batch)


@needs_triton
@pytest.mark.parametrize("lens", [DECODE, PREFILL_WITH_PREFIX, PREFILL_FRESH, MIXED],
                         ids=["decode", "prefill-with-prefix", "prefill-fresh", "mixed"])
def test_batch_kinds(paged_batch, lens):
    assert_kernel_matches_reference(paged_batch(*lens, num_heads=8, num_kv_heads=2))


@needs_triton
@pytest.mark.parametrize("sliding_window", [1, 5, 16, 40])
def test_sliding_window(paged_batch, sliding_window):
    # Long contexts, so whole key tiles fall before the window and are skipped.
    batch = paged_batch([150, 0, 90], [1, 70, 20], num_heads=4, num_kv_heads=1)
    assert_kernel_matches_reference(batch, sliding_window=sliding_window)


@needs_triton
def test_sliding_window_never_reads_keys_far_before_the_window(paged_batch):
    # Key tiles are at most 64 wide and start at multiples of their width, so every
    # key before the 64-aligned start of a query's window lies in a tile the kernel
    # must skip. Poisoning those keys with NaN after computing the expected output
    # shows they are never loaded.
    window = 10
    batch = paged_batch([200, 150], [1, 1], num_heads=4, num_kv_heads=2, block_size=16)
    expected = paged_attention_reference(*batch.args(), 0.125, sliding_window=window)
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        first_read = (seq_len - window) // 64 * 64
        for pos in range(first_read):
            block = batch.block_tables[seq, pos // 16]
            batch.k_cache[block, pos % 16] = float("nan")
            batch.v_cache[block, pos % 16] = float("nan")
    out = paged_attention(*batch.args(), 0.125, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_softcap(paged_batch, sliding_window):
    batch = paged_batch(*MIXED, num_heads=4, num_kv_heads=2)
    batch.q *= 4  # large scores, so the cap bends them
    assert_kernel_matches_reference(batch, softcap=3.0, sliding_window=sliding_window)


@needs_triton
@pytest.mark.parametrize("feature", FEATURES)
def test_attention_features(paged_batch, feature):
    """Sinks, ALiBi and chunked attention (engine/attention/context.py's AttentionOptions),
    over decoding requests, prefill chunks with and without a cached context."""
    batch = paged_batch([21, 0, 70, 3], [1, 18, 1, 45], num_heads=8, num_kv_heads=2, head_dim=32)
    assert_kernel_matches_reference(batch, **feature_options(feature, 8))


@needs_triton
def test_chunks_never_read_keys_before_the_first_querys_chunk(paged_batch):
    """Key tiles wholly before a tile's first query's chunk are skipped: keys there
    poisoned with NaN after computing the expected output are never loaded."""
    batch = paged_batch([200, 150], [1, 1], num_heads=4, num_kv_heads=2, block_size=16)
    expected = paged_attention_reference(*batch.args(), 0.125, chunk_size=32)
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        position = seq_len - 1
        first_read = (position - position % 32) // 64 * 64
        for pos in range(first_read):
            block = batch.block_tables[seq, pos // 16]
            batch.k_cache[block, pos % 16] = float("nan")
            batch.v_cache[block, pos % 16] = float("nan")
    out = paged_attention(*batch.args(), 0.125, chunk_size=32)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("head_dim,value_head_dim,dtype,tolerance", [(48, 32, torch.float32, 2e-5),
                                                                     (192, 128, torch.float32, 2e-5),
                                                                     (64, 128, torch.bfloat16, 2e-2)])
def test_value_head_size_of_its_own(paged_batch, head_dim, value_head_dim, dtype, tolerance):
    """Values of another head size than keys (multi-head latent attention's layout)."""
    batch = paged_batch(*MIXED, num_heads=4, num_kv_heads=2, head_dim=head_dim, value_head_dim=value_head_dim,
                        dtype=dtype)
    assert_kernel_matches_reference(batch, atol=tolerance, rtol=tolerance, sinks=feature_options("sinks", 4)["sinks"])


@needs_triton
@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 1e-2), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
def test_half_precision(paged_batch, lens, dtype, tolerance):
    batch = paged_batch(*lens, num_heads=8, num_kv_heads=2, head_dim=80, dtype=dtype)
    assert_kernel_matches_reference(batch, atol=tolerance, rtol=tolerance,
                                    sliding_window=20, softcap=30.0)


@needs_triton
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(7, 1, 64, 16),  # a group that is not a power of two (Qwen2.5-0.5B has 14/2)
     (16, 2, 64, 8),  # block smaller than a key tile; 8 queries per kv head
     (2, 2, 96, 64),
     (2, 1, 256, 16)],
)
def test_other_shapes(paged_batch, num_heads, num_kv_heads, head_dim, block_size):
    batch = paged_batch(*MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, block_size=block_size)
    assert_kernel_matches_reference(batch)


@needs_triton
def test_strided_q_and_empty_query(paged_batch):
    # A sequence with no new tokens is skipped; q is a view into a fused qkv tensor.
    batch = paged_batch([10, 30, 4], [5, 0, 1], num_heads=4, num_kv_heads=2)
    qkv = torch.randn(batch.q.shape[0], 8, batch.q.shape[2], device=DEVICE)
    qkv[:, :4] = batch.q
    batch.q = qkv[:, :4]
    assert not batch.q.is_contiguous()
    assert_kernel_matches_reference(batch)


@needs_triton
def test_max_query_len_given(paged_batch):
    batch = paged_batch(*MIXED)
    out = paged_attention(*batch.args(), 0.125, max_query_len=18)
    torch.testing.assert_close(out, paged_attention_reference(*batch.args(), 0.125),
                               atol=2e-5, rtol=1e-5)


@needs_triton
def test_chunked_prefill_then_decode_matches_dense_attention():
    # A user-level check: store the KV chunk by chunk, attend, and compare with
    # ordinary causal attention over the whole sequence.
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, seq_len = 4, 2, 64, 16, 45
    q = torch.randn(seq_len, num_heads, head_dim, device=DEVICE)
    k = torch.randn(seq_len, num_kv_heads, head_dim, device=DEVICE)
    v = torch.randn(seq_len, num_kv_heads, head_dim, device=DEVICE)
    k_cache = torch.zeros(6, block_size, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.tensor([[4, 0, 5]], dtype=torch.int32, device=DEVICE)
    offsets = torch.arange(seq_len, device=DEVICE)
    slots = block_table[0].long()[offsets // block_size] * block_size + offsets % block_size
    out = torch.empty_like(q)
    for start, end in [(0, 20), (20, 44), (44, 45)]:  # two prefill chunks, one decode
        store_kv_cache(k[start:end], v[start:end], k_cache, v_cache, slots[start:end])
        out[start:end] = paged_attention(
            q[start:end], k_cache, v_cache,
            torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE),
            torch.tensor([end], dtype=torch.int32, device=DEVICE), block_table, head_dim**-0.5)
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out, dense, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_reference_matches_dense_attention(paged_batch, sliding_window):
    batch = paged_batch([0], [30], num_heads=4, num_kv_heads=1, dtype=torch.float64)
    k = batch.k_cache[batch.block_tables[0, :2].long()].reshape(-1, 1, 64)[:30]
    v = batch.v_cache[batch.block_tables[0, :2].long()].reshape(-1, 1, 64)[:30]
    pos = torch.arange(30, device=DEVICE)
    visible = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        visible &= pos[:, None] - pos[None, :] < sliding_window
    dense = F.scaled_dot_product_attention(
        batch.q.transpose(0, 1), k.expand(-1, 4, -1).transpose(0, 1),
        v.expand(-1, 4, -1).transpose(0, 1), attn_mask=visible, scale=0.125).transpose(0, 1)
    out = paged_attention_reference(*batch.args(), 0.125, sliding_window=sliding_window)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, dense)


@needs_triton
def test_rejects_float64(paged_batch):
    batch = paged_batch(*DECODE, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        paged_attention(*batch.args(), 0.125)


@needs_triton
@pytest.mark.parametrize("options", [{"sliding_window": 0}, {"sliding_window": 2.5},
                                     {"softcap": 0.0}, {"chunk_size": 0}])
def test_rejects_bad_options(paged_batch, options):
    batch = paged_batch(*DECODE)
    with pytest.raises(ValueError, match=next(iter(options))):
        paged_attention(*batch.args(), 0.125, **options)


@needs_triton
def test_asserts_layout(paged_batch):
    batch = paged_batch(*DECODE)
    with pytest.raises(AssertionError, match="contiguous"):
        paged_attention(batch.q, batch.k_cache.transpose(1, 2), batch.v_cache.transpose(1, 2),
                        *batch.args()[3:], 0.125)
    with pytest.raises(AssertionError, match="int32"):
        paged_attention(*batch.args()[:4], batch.seq_lens.long(), batch.block_tables, 0.125)
