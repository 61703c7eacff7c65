"""The CPU causal attention of prefill chunks (C, through ctypes) against the plain-torch reference."""

import shutil

import pytest
import torch

from shardline.engine.kernels import paged_attention_reference
from shardline.engine.kernels.cpu_prefill_attention import prefill_attention, prefill_kernel_available

from .conftest import FEATURE_DTYPES, feature_options, make_paged_batch

# bfloat16 is read into float32 and rounded once on the way out: one bfloat16 step (with
# AVX512_BF16 the probabilities are rounded to bfloat16 before P.V, as torch's are).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # atol and rtol

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: prefill chunks attend through SDPA"),
              pytest.mark.usefixtures("kernel_target")]  # each build target in turn


def run_kernel(batch, requests: list[int], scale: float, sliding_window=None, softcap=None, strided=False,
               **features):
    q, k_cache, v_cache = batch.q.cpu(), batch.k_cache.cpu(), batch.v_cache.cpu()
    if strided:  # queries as a view of a wider projection output, as the fused layers make them
        wide = torch.zeros(q.shape[0], q.shape[1] + 3, q.shape[2], dtype=q.dtype)
        wide[:, 1 : 1 + q.shape[1]] = q
        q = wide[:, 1 : 1 + q.shape[1]]
    # rows the kernel must leave alone keep 7
    out = torch.full((*q.shape[:2], v_cache.shape[3]), 7.0, dtype=q.dtype)
    assert prefill_kernel_available(k_cache, q.shape[1], v_cache.shape[3])
    prefill_attention(q, k_cache, v_cache, batch.block_tables.cpu(), batch.query_start_loc.cpu().long(),
                      batch.seq_lens.cpu().long(), torch.tensor(requests, dtype=torch.int64), out, scale,
                      sliding_window, softcap, **features)
    return out


def check(context_lens, query_lens, requests=None, sliding_window=None, softcap=None, strided=False,
          scale=None, features=None, **batch_options):
    batch = make_paged_batch(context_lens, query_lens, **batch_options)
    requests = list(range(len(query_lens))) if requests is None else requests
    scale = scale or batch.q.shape[-1] ** -0.5
    features = features or {}
    out = run_kernel(batch, requests, scale, sliding_window, softcap, strided, **features)
    # float64 in, so a bfloat16 batch's answer is the exact one for its stored values.
    expected = paged_attention_reference(batch.q.cpu().double(), batch.k_cache.cpu().double(),
                                         batch.v_cache.cpu().double(), batch.query_start_loc.cpu(),
                                         batch.seq_lens.cpu(), batch.block_tables.cpu(), scale, sliding_window,
                                         softcap, **features)
    starts = batch.query_start_loc.tolist()
    written = torch.zeros(out.shape[0], dtype=torch.bool)
    for request in requests:
        written[starts[request] : starts[request + 1]] = True
    tolerance = TOLERANCE[out.dtype]
    torch.testing.assert_close(out[written], expected[written].to(out.dtype), atol=tolerance, rtol=tolerance)
    assert bool((out[~written] == 7.0).all())


FRESH = ([0, 0, 0, 0], [2, 17, 64, 250])
WITH_CONTEXT = ([16, 5, 300, 31], [23, 40, 9, 2])
LONG = ([0, 700], [513, 100])


@pytest.mark.parametrize("feature,dtype", FEATURE_DTYPES)
def test_attention_features(feature, dtype):
    """Sinks, ALiBi and chunked attention (engine/attention/context.py's AttentionOptions),
    with contexts long enough that chunks and skipped key blocks occur."""
    check([0, 16, 5, 60], [40, 23, 2, 70], num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype,
          features=feature_options(feature, 8))


@pytest.mark.parametrize("head_dim,value_head_dim,dtype", [(48, 32, torch.float32), (192, 128, torch.float32),
                                                           (64, 128, torch.bfloat16)])
def test_value_head_size_of_its_own(head_dim, value_head_dim, dtype):
    """Values of another head size than keys (multi-head latent attention's layout)."""
    check([0, 16, 30], [33, 20, 1], num_heads=4, num_kv_heads=2, head_dim=head_dim,
          value_head_dim=value_head_dim, dtype=dtype, sliding_window=25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [FRESH, WITH_CONTEXT, LONG], ids=["fresh", "with-context", "long"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2), (16, 2), (6, 1)])
def test_matches_reference(lens, num_heads, num_kv_heads, dtype):
    check(*lens, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_block_sizes(block_size):
    check(*WITH_CONTEXT, block_size=block_size, strided=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 32, 48, 128, 256])
def test_head_dims(head_dim, dtype):
    check([0, 20], [40, 77], head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [1, 5, 16, 17, 40, 1000])
def test_sliding_window(sliding_window, dtype):
    check([0, 0, 50, 7, 300], [3, 90, 39, 16, 200], sliding_window=sliding_window, block_size=8, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("softcap", [2.0, 5.0, 50.0])
def test_softcap(softcap, sliding_window, dtype):
    """Scores of both signs well past the cap (scale 1 on head size 64), and near 0."""
    check([0, 0, 50, 7], [3, 90, 39, 16], sliding_window=sliding_window, softcap=softcap, scale=1.0,
          dtype=dtype)


def image_key_limits(context_lens, query_lens, spans):
    """[T] the last key each query row sees: its own position, or for rows of an image
    (spans[b]: positions first .. last - 1 of request b, or None) the image's last."""
    limits = []
    for context, length, span in zip(context_lens, query_lens, spans):
        positions = torch.arange(context, context + length)
        if span is not None:
            inside = (positions >= span[0]) & (positions < span[1])
            positions = torch.where(inside, torch.full_like(positions, span[1] - 1), positions)
        limits.append(positions)
    return torch.cat(limits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 6, 40])
def test_image_rows_see_their_whole_image(sliding_window, dtype):
    """Rows of an image attending both ways (Gemma 3) see up to the image's last row
    (StepBatch.key_limits), with the other rows causal, windows as before; images at
    a chunk's start, its end, spanning tile and key-block edges, and none."""
    context_lens, query_lens = [0, 20, 5, 0, 64], [90, 45, 3, 37, 70]
    spans = [(10, 74), (20, 26), None, (0, 37), (100, 131)]
    limits = image_key_limits(context_lens, query_lens, spans)
    check(context_lens, query_lens, num_heads=8, num_kv_heads=2, dtype=dtype, sliding_window=sliding_window,
          features=dict(key_limits=limits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2), (16, 2), (32, 1)])
def test_tiles_and_blocks_of_every_size(num_heads, num_kv_heads, head_dim, dtype):
    """Prompts of 1 row, rows just past and short of a tile (128 query rows of a KV
    head) and of a key block (32 keys), chunks continuing a cached prefix; each query
    head group size the tiles split differently."""
    check([0, 0, 0, 31, 100, 7, 0], [1, 33, 65, 2, 97, 130, 127], num_heads=num_heads, num_kv_heads=num_kv_heads,
          head_dim=head_dim, dtype=dtype)


def test_only_listed_requests_are_written():
    """A mixed step: decoding requests (one query token) are the decode kernel's."""
    check([10, 0, 33, 7], [1, 12, 1, 5], requests=[1, 3])


def test_takes_only_what_it_computes():
    cache = torch.zeros(4, 16, 4, 64)
    assert prefill_kernel_available(cache, 8) and prefill_kernel_available(cache.bfloat16(), 8)
    assert not prefill_kernel_available(cache.double(), 8)  # float64: SDPA, the exact reference path
    assert not prefill_kernel_available(cache.half(), 8)
    assert not prefill_kernel_available(cache[..., :40], 8)  # head size not a multiple of 16
    assert not prefill_kernel_available(torch.zeros(4, 16, 4, 512), 8)  # above the maximum
    assert not prefill_kernel_available(cache, 6)  # 6 query heads over 4 KV heads
