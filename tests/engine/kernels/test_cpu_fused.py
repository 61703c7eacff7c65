"""The fused CPU elementwise kernels (C, through ctypes) against transformers' formulas."""

import shutil

import pytest
import torch

from shardline.engine.kernels.cpu_fused import (
    add_,
    add_rms_norm_,
    fused_kernels_available,
    kv_write,
    kv_write_noting,
    kv_write_takes,
    rms_norm,
    rms_norm_heads,
    rms_norm_reference,
    rotary_,
    rotary_reference,
    silu_mul,
    silu_mul_reference,
)

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine keeps its torch ops"),
              pytest.mark.usefixtures("kernel_target")]  # each build target in turn

# float32: a few ulp (another summation order, fused multiply-adds); bfloat16: the
# kernels round where the reference rounds, so results differ by at most one
# bfloat16 step where a float32 intermediate falls near a rounding boundary.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 3, 64, 300]  # below and above the kernels' threshold for threads


def generator():
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", [16, 512, 1000])
def test_rms_norm(dtype, rows, cols):
    assert fused_kernels_available(dtype)
    x = (torch.randn(rows, cols, generator=generator()) * 3).to(dtype)
    weight = torch.randn(cols, generator=generator()).to(dtype)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_strided_rows(dtype):
    """Rows of a wider matrix (a view): the kernel follows the row stride."""
    wide = torch.randn(7, 96, generator=generator()).to(dtype)
    x = wide[:, 16:80]
    weight = torch.rand(64, generator=generator()).to(dtype)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rms_norm_heads_is_rms_norm_of_the_heads_gathered(dtype, tokens):
    """The heads of q in a q/k/v projection's output (tokens a wider row apart): the same
    results, bit for bit, as the norm of the rows copied together."""
    qkv = (torch.randn(tokens, 4 * 64 + 2 * 2 * 64, generator=generator()) * 3).to(dtype)
    query = qkv[:, : 4 * 64].view(tokens, 4, 64)
    weight = torch.randn(64, generator=generator()).to(dtype)
    assert torch.equal(rms_norm_heads(query, weight, 1e-6), rms_norm(query.reshape(-1, 64), weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_updates_the_residual_in_place(dtype, rows):
    x = torch.randn(rows, 512, generator=generator()).to(dtype)
    delta = torch.randn(rows, 512, generator=generator()).to(dtype)
    weight = torch.randn(512, generator=generator()).to(dtype)
    expected_sum = x + delta
    out = add_rms_norm_(x, delta, weight, 1e-6)
    assert torch.equal(x, expected_sum)
    torch.testing.assert_close(out, rms_norm_reference(expected_sum, weight, 1e-6), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [1536, 1001])  # whole vectors; a row's last elements past them
def test_silu_mul(dtype, rows, width):
    gate_up = (torch.randn(rows, 2 * width, generator=generator()) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and zero
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_reference(gate_up), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 4, 64), (4, 4, 16), (16, 2, 128), (3, 1, 32)])
def test_rotary(dtype, tokens, num_heads, num_kv_heads, head_dim):
    """q and k as views of one linear output each ([T, H * D]), as a layer has them."""
    q = torch.randn(tokens, num_heads * head_dim, generator=generator()).to(dtype).view(tokens, num_heads, head_dim)
    k = torch.randn(tokens, num_kv_heads * head_dim, generator=generator()).to(dtype).view(
        tokens, num_kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, generator=generator()) * 100
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected_q, expected_k = rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)
    rotary_(q, k, cos, sin)
    torch.testing.assert_close(q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k, expected_k, **TOLERANCE[dtype])


def test_other_dtypes_are_not_taken():
    assert not fused_kernels_available(torch.float64)
    assert not fused_kernels_available(torch.float16)


def test_bfloat16_rounding_is_torchs_bit_for_bit():
    """The residual add (x += delta) rounds each float32 sum to bfloat16 as torch does,
    on whole vectors and on a row's last elements: to nearest even at exact ties,
    subnormals kept, overflow to infinity, NaN stays NaN."""
    halves = torch.tensor([1.0, 2 ** -8, 3 * 2 ** -9, 2 ** -9, 1e-39, 3e38, float("inf"), float("nan"), -0.0, -2.5])
    base = torch.tensor([1.0, 1.0, 1.0, 1.0, 1e-39, 3e38, 1.0, 1.0, 0.0, 7.0])
    x = torch.cat([base, (torch.randn(990, generator=generator()) * 100)]).to(torch.bfloat16)
    delta = torch.cat([halves, torch.randn(990, generator=generator())]).to(torch.bfloat16)
    rows = torch.stack([x, x.flip(0)]), torch.stack([delta, delta.flip(0)])  # specials in the tail too
    expected = rows[0] + rows[1]  # torch: float32 sum, rounded to nearest even
    residual = rows[0].clone()
    add_rms_norm_(residual, rows[1], torch.ones(1000, dtype=torch.bfloat16), 1e-6)
    assert torch.equal(residual.view(torch.int16)[~expected.isnan()], expected.view(torch.int16)[~expected.isnan()])
    assert torch.equal(residual.isnan(), expected.isnan())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_is_torchs_add_bit_for_bit(dtype, rows):
    """x += delta in place over rows a stride apart (the residual add of the fused
    layers), rounded as torch's add_ rounds: equal bit for bit."""
    wide = (torch.randn(rows, 1100, generator=generator()) * 50).to(dtype)
    x, delta = wide[:, :1000], (torch.randn(rows, 1000, generator=generator()) * 3).to(dtype)
    expected = x + delta
    assert add_(x, delta) is x
    assert torch.equal(x, expected)
    assert torch.equal(wide[:, 1000:], (torch.randn(rows, 1100, generator=generator()) * 50).to(dtype)[:, 1000:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 4, 21])
def test_kv_write_is_index_copy(dtype, tokens):
    """Keys and values (views of one fused q/k/v output, as a decoder layer's) land in
    their slots exactly as index_copy_ puts them; slots no token names stay NaN."""
    num_kv_heads, head_dim, value_dim, blocks, block_size = 2, 16, 8, 7, 4
    qkv = torch.randn(tokens, 3 * num_kv_heads * head_dim, generator=generator()).to(dtype)
    key = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    value = qkv[:, -num_kv_heads * value_dim:].view(tokens, num_kv_heads, value_dim)
    slots = torch.randperm(blocks * block_size, generator=generator())[:tokens]
    caches = [torch.full((blocks, block_size, num_kv_heads, dim), float("nan"), dtype=dtype)
              for dim in (head_dim, value_dim)]
    expected = [cache.clone() for cache in caches]
    expected[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    expected[1].view(-1, num_kv_heads, value_dim).index_copy_(0, slots, value)
    assert kv_write_takes(key, value, *caches, slots)
    kv_write(key, value, *caches, slots)
    for actual, reference in zip(caches, expected, strict=True):
        assert torch.equal(actual.nan_to_num(-7.0), reference.nan_to_num(-7.0))


def test_kv_write_refuses_a_slot_outside_the_cache_and_writes_nothing():
    caches = [torch.zeros(2, 4, 1, 8) for _ in range(2)]
    rows = torch.ones(2, 1, 8)
    with pytest.raises(IndexError, match="1 of 2 KV cache slots outside the cache's 8"):
        kv_write(rows, rows, *caches, torch.tensor([3, 8]))
    assert not any(cache.any() for cache in caches)


def test_kv_write_noting_writes_as_kv_write_and_keeps_the_largest_count_out_of_range():
    """The replayable variant: the same writes; slots out of range write nothing and
    their count is kept where it passes the counter's (each layer of a step checks the
    same slots, so the counter holds one write's count)."""
    caches = [torch.zeros(2, 4, 1, 8) for _ in range(2)]
    expected = [torch.zeros(2, 4, 1, 8) for _ in range(2)]
    rows = torch.randn(2, 1, 8, generator=generator())
    counter = torch.zeros(1, dtype=torch.int64)
    kv_write_noting(rows, rows, *caches, torch.tensor([3, 6]), counter)
    kv_write(rows, rows, *expected, torch.tensor([3, 6]))
    assert int(counter) == 0 and all(torch.equal(a, b) for a, b in zip(caches, expected, strict=True))
    kv_write_noting(rows * 2, rows * 2, *caches, torch.tensor([8, -1]), counter)
    kv_write_noting(rows * 2, rows * 2, *caches, torch.tensor([1, 9]), counter)
    assert int(counter) == 2  # the larger count, not the sum
    assert all(torch.equal(a, b) for a, b in zip(caches, expected, strict=True))  # nothing written


def test_kv_write_does_not_take_what_it_cannot_copy_as_rows():
    caches = [torch.zeros(2, 4, 2, 8) for _ in range(2)]
    rows, slots = torch.ones(3, 2, 8), torch.tensor([0, 1, 2])
    assert kv_write_takes(rows, rows, *caches, slots)
    assert not kv_write_takes(rows.transpose(1, 2).contiguous().transpose(1, 2), rows, *caches, slots)  # heads apart
    assert not kv_write_takes(rows.double(), rows, *caches, slots)  # another dtype than the cache's
    assert not kv_write_takes(rows, rows, *caches, slots.int())
    assert not kv_write_takes(rows, rows, caches[0].transpose(0, 1), caches[1], slots)
