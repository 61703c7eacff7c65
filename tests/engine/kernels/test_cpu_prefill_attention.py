"""The CPU causal attention of fresh prompts (C, through ctypes) against its plain-torch reference."""

import shutil

import pytest
import torch

from shardline.engine.kernels.cpu_prefill_attention import (prefill_attention, prefill_attention_reference,
                                                           prefill_kernel_available)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: fresh prompts attend through SDPA")


def packed_step(lengths: list[int], num_heads: int, num_kv_heads: int, head_dim: int, gap: int = 3, seed: int = 0):
    """Queries, keys and values as views of one packed projection output ([T, (H +
    2 Hkv) D], as the fused layers make them), the prompts separated by ``gap`` rows
    of other requests; returns them with each prompt's (first, end) rows."""
    generator = torch.Generator().manual_seed(seed)
    bounds, row = [], 0
    for length in lengths:
        row += gap
        bounds.append((row, row + length))
        row += length
    width = (num_heads + 2 * num_kv_heads) * head_dim
    packed = torch.randn(row + gap, width, generator=generator) * 2
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    split = (packed[:, :q_end], packed[:, q_end:k_end], packed[:, k_end:])
    query, key, value = (part.view(row + gap, -1, head_dim) for part in split)
    return query, key, value, bounds


def run_kernel(query, key, value, bounds, scale, sliding_window=None):
    out = torch.full(query.shape, 7.0)  # rows of other requests must keep 7
    assert prefill_kernel_available(query, key, None)
    prefill_attention(query, key, value, bounds, out, scale, sliding_window)
    return out


def check(lengths, num_heads=8, num_kv_heads=4, head_dim=64, sliding_window=None):
    query, key, value, bounds = packed_step(lengths, num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    out = run_kernel(query, key, value, bounds, scale, sliding_window)
    expected = prefill_attention_reference(query, key, value, bounds, scale, sliding_window)
    prompt_rows = torch.zeros(query.shape[0], dtype=torch.bool)
    for first, end in bounds:
        prompt_rows[first:end] = True
    torch.testing.assert_close(out[prompt_rows].double(), expected[prompt_rows], atol=2e-5, rtol=2e-5)
    assert bool((out[~prompt_rows] == 7.0).all())


@pytest.mark.parametrize("lengths", [[1], [2, 17], [16, 15, 33], [100, 7, 64, 250], [513]])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2), (16, 2), (6, 1)])
def test_matches_reference(lengths, num_heads, num_kv_heads):
    check(lengths, num_heads, num_kv_heads)


@pytest.mark.parametrize("head_dim", [16, 32, 48, 128, 256])
def test_head_dims(head_dim):
    check([5, 40, 77], head_dim=head_dim)


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 17, 40, 1000])
def test_sliding_window(sliding_window):
    check([3, 16, 39, 90, 200], sliding_window=sliding_window)


def test_takes_only_what_it_computes():
    query, key, value, _ = packed_step([4], 8, 4, 64)
    assert prefill_kernel_available(query, key, None)
    assert not prefill_kernel_available(query, key, 30.0)  # softcap: SDPA's path
    assert not prefill_kernel_available(query.double(), key.double(), None)
    assert not prefill_kernel_available(query.bfloat16(), key.bfloat16(), None)
    assert not prefill_kernel_available(query[..., :40], key[..., :40], None)  # head size not a multiple of 16
    assert not prefill_kernel_available(torch.zeros(3, 8, 512), torch.zeros(3, 4, 512), None)  # above the maximum
