"""The CPU prefill attention's bfloat16 products through AMX tiles (cpu_prefill_blocks.h:
S^T = K . Q^T and out^T += V^T . P^T as tile multiplies) against the float64 reference,
where the host grants the tiles; each case also with the tiles disallowed, where the
AVX512_BF16 dot-product path runs it, as on a host without AMX."""

import pytest
import torch

from shardline.engine.kernels.cpu_prefill_attention import allow_amx_tiles, amx_tiles_ready

from .conftest import feature_options
from .test_cpu_prefill_attention import FRESH, LONG, WITH_CONTEXT, check, image_key_limits

pytestmark = pytest.mark.skipif(not amx_tiles_ready(), reason="no AMX tiles for the prefill attention on this host")


@pytest.fixture(params=[True, False], ids=["amx", "no_amx"])
def amx(request):
    allow_amx_tiles(request.param)
    assert amx_tiles_ready() == request.param
    yield request.param
    allow_amx_tiles(True)


@pytest.mark.parametrize("lens", [FRESH, WITH_CONTEXT, LONG], ids=["fresh", "with-context", "long"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2), (16, 2), (6, 1)])
def test_matches_reference(amx, lens, num_heads, num_kv_heads):
    check(*lens, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=torch.bfloat16)


@pytest.mark.parametrize("head_dim", [32, 48, 64, 128, 256])
def test_head_dims(amx, head_dim):
    """Whole runs of 32 head elements take the tiles; 48 stays on the dot-product path."""
    check([0, 20], [40, 77], head_dim=head_dim, dtype=torch.bfloat16)


def test_value_head_size_of_its_own(amx):
    check([0, 16, 30], [33, 20, 1], num_heads=4, num_kv_heads=2, head_dim=64, value_head_dim=128,
          dtype=torch.bfloat16, sliding_window=25)


@pytest.mark.parametrize("sliding_window", [1, 17, 40])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_windows_and_softcaps(amx, sliding_window, softcap):
    """Keys masked inside a block and whole halves of blocks past the rows' last key."""
    check([0, 0, 50, 7, 300], [3, 90, 39, 16, 200], sliding_window=sliding_window, softcap=softcap,
          scale=1.0 if softcap else None, block_size=8, dtype=torch.bfloat16)


@pytest.mark.parametrize("feature", ["sinks", "alibi", "chunked", "all"])
def test_attention_features(amx, feature):
    check([0, 16, 5, 60], [40, 23, 2, 70], num_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16,
          features=feature_options(feature, 8))


def test_image_rows_see_their_whole_image(amx):
    context_lens, query_lens = [0, 20, 5, 0, 64], [90, 45, 3, 37, 70]
    spans = [(10, 74), (20, 26), None, (0, 37), (100, 131)]
    check(context_lens, query_lens, num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, sliding_window=40,
          features=dict(key_limits=image_key_limits(context_lens, query_lens, spans)))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (32, 1)])
def test_tiles_and_blocks_of_every_size(amx, num_heads, num_kv_heads, head_dim):
    check([0, 0, 0, 31, 100, 7, 0], [1, 33, 65, 2, 97, 130, 127], num_heads=num_heads, num_kv_heads=num_kv_heads,
          head_dim=head_dim, dtype=torch.bfloat16)


def test_tiles_agree_with_the_dot_product_path():
    """The two paths sum the same exact products of bfloat16 values in float32, in
    another order: their outputs differ by at most a rounding of the bfloat16 output."""
    from .conftest import make_paged_batch
    from .test_cpu_prefill_attention import run_kernel

    batch = make_paged_batch([0, 40, 300], [257, 33, 64], num_heads=8, num_kv_heads=2, head_dim=128,
                             dtype=torch.bfloat16)
    scale = 128 ** -0.5
    outputs = []
    for allowed in (True, False):
        allow_amx_tiles(allowed)
        outputs.append(run_kernel(batch, [0, 1, 2], scale).float())
    allow_amx_tiles(True)
    tiles, dot = outputs
    assert not torch.equal(tiles, torch.zeros_like(tiles))
    # one bfloat16 step of the larger (8 bits of mantissa)
    torch.testing.assert_close(tiles, dot, rtol=2 ** -7, atol=1e-3)
