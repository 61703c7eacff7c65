"""store_kv_cache (Triton, interpreted on CPU) against its plain-torch reference."""

import pytest
import torch

from shardline.engine.kernels import store_kv_cache, store_kv_cache_reference, triton_available

from .conftest import DEVICE

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def make_store_case(num_tokens, num_kv_heads, head_dim, dtype, block_size=16, num_blocks=6, value_head_dim=None):
    generator = torch.Generator().manual_seed(0)
    value_head_dim = value_head_dim or head_dim
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, value_head_dim, generator=generator).to(dtype)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    v_cache = torch.randn((*cache_shape[:3], value_head_dim), generator=generator).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::3] = -1  # every third token is not stored
    return tuple(t.to(DEVICE) for t in (k, v, k_cache, v_cache, slots))


def assert_store_matches_reference(k, v, k_cache, v_cache, slots):
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_cache_reference(k, v, expected_k, expected_v, slots)
    store_kv_cache(k, v, k_cache, v_cache, slots)
    # Bit-exact, including every slot that must stay untouched.
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 64), (3, 80), (1, 128)])
def test_matches_reference(num_kv_heads, head_dim, dtype):
    assert_store_matches_reference(*make_store_case(20, num_kv_heads, head_dim, dtype))


@pytest.mark.parametrize("head_dim,value_head_dim", [(48, 32), (192, 128), (64, 80)])
def test_values_of_their_own_head_size(head_dim, value_head_dim):
    """Multi-head latent attention's layout: values cached at their own head size."""
    assert_store_matches_reference(*make_store_case(20, 2, head_dim, torch.float32, value_head_dim=value_head_dim))


def test_reference_writes_the_slots():
    k, v, k_cache, v_cache, slots = make_store_case(9, 2, 64, torch.float32)
    store_kv_cache_reference(k, v, k_cache, v_cache, slots)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 16, slot % 16], k[token])
            assert torch.equal(v_cache[slot // 16, slot % 16], v[token])


def test_strided_views_of_fused_qkv():
    k, v, k_cache, v_cache, slots = make_store_case(12, 2, 64, torch.bfloat16)
    qkv = torch.randn(12, 8, 64, device=DEVICE).to(torch.bfloat16)  # [T, H + 2 * Hkv, D]
    qkv[:, 4:6], qkv[:, 6:8] = k, v
    assert_store_matches_reference(qkv[:, 4:6], qkv[:, 6:8], k_cache, v_cache, slots)


def test_no_tokens_is_a_no_op():
    k, v, k_cache, v_cache, slots = make_store_case(0, 2, 64, torch.float32)
    before = k_cache.clone()
    store_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, before)


def test_rejects_float64_and_bad_layouts():
    k, v, k_cache, v_cache, slots = make_store_case(4, 2, 64, torch.float64)
    with pytest.raises(TypeError, match="float64"):
        store_kv_cache(k, v, k_cache, v_cache, slots)
    k, v, k_cache, v_cache, slots = make_store_case(4, 2, 64, torch.float32)
    with pytest.raises(AssertionError, match="int64"):
        store_kv_cache(k, v, k_cache, v_cache, slots.int())
    with pytest.raises(AssertionError, match="does not match cache"):
        store_kv_cache(k[:, :1], v[:, :1], k_cache, v_cache, slots)
