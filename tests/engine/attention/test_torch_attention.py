"""The plain-torch paged attention (the CPU path) against the kernels' plain reference."""

from __future__ import annotations

import shutil

import pytest
import torch

from shardline.engine.attention.backends import StepBatch, TorchBackend
from shardline.engine.attention.context import AttentionOptions
from shardline.engine.attention.torch_path import padded_attention, torch_paged_attention
from shardline.engine.attention.torch_plans import DECODE_GROUP_SIZE, attention_groups, fresh_prompts
from shardline.engine.kernels import paged_attention_reference

# (context_lens, query_lens): cached tokens and new tokens per request.
DECODE = ([7, 33, 0, 64], [1, 1, 1, 1])
MANY_DECODE = ([5 + 37 * i % 300 for i in range(21)], [1] * 21)  # three decode groups
PREFILL_WITH_PREFIX = ([16, 40], [23, 9])
PREFILL_FRESH = ([0] * 5, [19, 5, 64, 50, 47])  # 64, 50 and 47 share a group
MIXED = ([21, 0, 50, 3, 0, 90, 17], [1, 18, 1, 12, 1, 1, 30])
BATCHES = [DECODE, MANY_DECODE, PREFILL_WITH_PREFIX, PREFILL_FRESH, MIXED]
BATCH_IDS = ["decode", "many-decode", "prefill-with-prefix", "prefill-fresh", "mixed"]


def make_step(context_lens, query_lens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
              dtype=torch.float64, seed=0, value_head_dim=None):
    """A step's query, paged cache and AttentionContext. Block ids are shuffled, table
    padding is block 0 (as the model runner pads), and every slot no request owns
    holds large values, so attending to one shows in the output."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    block_ids = torch.randperm(num_blocks, generator=generator).tolist()
    value_head_dim = value_head_dim or head_dim
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    value_shape = (num_blocks, block_size, num_kv_heads, value_head_dim)
    k_cache, v_cache = torch.full(shape, 1e3, dtype=dtype), torch.full(value_shape, -1e3, dtype=dtype)
    block_tables = torch.zeros((len(seq_lens), max(blocks_per_seq)), dtype=torch.int32)
    for seq, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        owned, block_ids = block_ids[:n_blocks], block_ids[n_blocks:]
        block_tables[seq, :n_blocks] = torch.tensor(owned, dtype=torch.int32)
        for pos in range(seq_len):
            k_cache[owned[pos // block_size], pos % block_size] = torch.randn(
                num_kv_heads, head_dim, generator=generator, dtype=dtype)
            v_cache[owned[pos // block_size], pos % block_size] = torch.randn(
                num_kv_heads, value_head_dim, generator=generator, dtype=dtype)
    query_start_loc = torch.tensor([0, *query_lens]).cumsum(0)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator, dtype=dtype)
    step = StepBatch(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64), query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens), block_tables=block_tables, kv_caches=[(k_cache, v_cache)],
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
    )
    return q, TorchBackend(num_heads).build_context(step)


def new_keys_and_values(ctx):
    """The step's new keys and values [T, Hkv, D], packed as its queries: what the
    model wrote into the cache this step."""
    k_cache, v_cache = ctx.kv_caches[0]
    block_size = k_cache.shape[1]
    starts, seq_lens = ctx.query_start_loc.tolist(), ctx.seq_lens.tolist()
    slots = []
    for b, seq_len in enumerate(seq_lens):
        table = ctx.block_tables[b].tolist()
        for position in range(seq_len - (starts[b + 1] - starts[b]), seq_len):
            slots.append(table[position // block_size] * block_size + position % block_size)
    slots = torch.tensor(slots)
    return (k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots])


def assert_matches_reference(q, ctx, sliding_window=None, softcap=None, atol=1e-10, rtol=1e-10, **features):
    """``features``: sinks, alibi_slopes, chunk_size (AttentionOptions)."""
    k_cache, v_cache = ctx.kv_caches[0]
    scale = q.shape[-1] ** -0.5
    work = ctx.work
    key, value = new_keys_and_values(ctx)
    options = AttentionOptions(scale, sliding_window, softcap, **features)
    out = torch_paged_attention(q, key, value, k_cache, v_cache, work, options)
    expected = paged_attention_reference(q, k_cache, v_cache, ctx.query_start_loc, ctx.seq_lens,
                                         ctx.block_tables, scale, sliding_window=sliding_window, softcap=softcap,
                                         **features)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:2], v_cache.shape[3])
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("lens", BATCHES, ids=BATCH_IDS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_matches_reference(lens, num_heads, num_kv_heads):
    assert_matches_reference(*make_step(*lens, num_heads=num_heads, num_kv_heads=num_kv_heads))


@pytest.mark.parametrize("lens", BATCHES, ids=BATCH_IDS)
@pytest.mark.parametrize("sliding_window", [1, 5, 40])
def test_sliding_window(lens, sliding_window):
    assert_matches_reference(*make_step(*lens), sliding_window=sliding_window)


@pytest.mark.parametrize("lens", BATCHES, ids=BATCH_IDS)
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_softcap(lens, sliding_window):
    q, ctx = make_step(*lens)
    assert_matches_reference(q * 4, ctx, sliding_window=sliding_window, softcap=3.0)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
@pytest.mark.parametrize("lens", BATCHES, ids=BATCH_IDS)
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (24, None), (None, 3.0)])
def test_native_kernels_where_they_apply(lens, sliding_window, softcap):
    """The "auto" backend on CPU in float32: decoding requests through the native
    decode kernel, every prefill chunk through the native prefill kernel."""
    q, ctx = make_step(*lens, dtype=torch.float32)
    backend = TorchBackend(q.shape[1], native_decode=True, native_prefill=True)
    ctx = backend.build_context(StepBatch(**{name: getattr(ctx, name) for name in StepBatch.__dataclass_fields__}))
    work = ctx.work
    query_lens = ctx.query_start_loc[1:] - ctx.query_start_loc[:-1]
    assert work.plans == [] and work.fresh == []
    assert (work.decode is not None) == bool((query_lens == 1).any())
    assert (work.prefill is not None) == bool((query_lens > 1).any())
    assert_matches_reference(q * 4 if softcap else q, ctx, sliding_window, softcap, atol=2e-5, rtol=2e-5)


def feature_options(feature: str, num_heads: int) -> dict:
    """One attention feature's options (AttentionOptions' fields), with values large
    enough to change every output: sink logits around the scores' size, ALiBi slopes
    of transformers' geometric series, chunks that cut the longer contexts."""
    generator = torch.Generator().manual_seed(7)
    if feature == "sinks":
        return dict(sinks=torch.randn(num_heads, generator=generator) * 2)
    if feature == "alibi":
        return dict(alibi_slopes=2.0 ** (-8.0 * torch.arange(1, num_heads + 1) / num_heads))
    if feature == "chunked":
        return dict(chunk_size=12)
    if feature == "all":
        return {**feature_options("sinks", num_heads), **feature_options("alibi", num_heads), "chunk_size": 20}
    raise ValueError(feature)


FEATURES = ["sinks", "alibi", "chunked", "all"]


@pytest.mark.parametrize("lens", BATCHES, ids=BATCH_IDS)
@pytest.mark.parametrize("feature", FEATURES)
def test_attention_features(lens, feature):
    q, ctx = make_step(*lens)
    assert_matches_reference(q * 3, ctx, **feature_options(feature, q.shape[1]))


@pytest.mark.parametrize("lens", [MIXED, PREFILL_FRESH], ids=["mixed", "prefill-fresh"])
@pytest.mark.parametrize("feature", [None, "sinks", "alibi"])
def test_value_head_size_differs_from_key_head_size(lens, feature):
    """Multi-head latent attention's layout: keys of 48, values of 32 per head."""
    q, ctx = make_step(*lens, head_dim=48, value_head_dim=32)
    assert_matches_reference(q, ctx, **(feature_options(feature, q.shape[1]) if feature else {}))


@pytest.mark.parametrize("block_size", [8, 32])
def test_float32_and_block_sizes(block_size):
    q, ctx = make_step(*MIXED, dtype=torch.float32, block_size=block_size)
    assert_matches_reference(q, ctx, atol=2e-5, rtol=1e-5)


def test_groups_cover_each_request_once_and_keep_kinds_apart():
    context_lens, query_lens = MIXED[0] + MANY_DECODE[0], MIXED[1] + MANY_DECODE[1]
    query_lens_t = torch.tensor(query_lens)
    seq_lens = torch.tensor([c + q for c, q in zip(context_lens, query_lens)])
    groups = attention_groups(query_lens_t, seq_lens)
    query_start_loc = torch.tensor([0, *query_lens]).cumsum(0)
    fresh = [query_start_loc.tolist().index(first) for first, _ in fresh_prompts(query_start_loc, seq_lens)]
    # Every request once: in a group, or a fresh prompt attended on its own.
    assert sorted(torch.cat(groups).tolist() + fresh) == list(range(len(query_lens)))
    assert fresh and all(1 < query_lens[b] == seq_lens[b] for b in fresh)
    for group in groups:
        decoding = query_lens_t[group] == 1
        assert bool(decoding.all()) or not bool(decoding.any())
        if bool(decoding.all()):
            assert len(group) <= DECODE_GROUP_SIZE


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_padded_attention_folds_gqa_like_repeated_heads(causal, softcap):
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(3, 6, 7, 16, generator=generator, dtype=torch.float64) * 3
    k = torch.randn(3, 2, 9, 16, generator=generator, dtype=torch.float64)
    v = torch.randn(3, 2, 9, 16, generator=generator, dtype=torch.float64)
    scores = q @ k.repeat_interleave(3, dim=1).transpose(-1, -2) * 0.25  # [3, 6, 7, 9]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        scores = scores.masked_fill(torch.ones(7, 9, dtype=torch.bool).tril().logical_not(), float("-inf"))
    expected = scores.softmax(-1) @ v.repeat_interleave(3, dim=1)
    out = padded_attention(q, k, v, None, causal, 0.25, softcap)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)


def test_keys_of_other_heads_than_the_cache_are_refused():
    """A view by the keys' own heads would scatter them over wrong slots silently."""
    from shardline.engine.attention.torch_path import write_kv_cache

    k_cache, v_cache = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    slots = torch.tensor([0, 1, 2])
    write_kv_cache(torch.ones(3, 2, 8), torch.ones(3, 2, 8), k_cache, v_cache, slots)
    assert k_cache.view(-1, 2, 8)[:3].eq(1).all() and k_cache.view(-1, 2, 8)[3:].eq(0).all()
    with pytest.raises(ValueError, match=r"keys \(1, 8\) and values \(1, 8\) .* KV cache's \(2, 8\) and \(2, 8\)"):
        write_kv_cache(torch.ones(3, 1, 8), torch.ones(3, 1, 8), k_cache, v_cache, slots)
