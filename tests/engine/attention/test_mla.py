"""Latent paged attention (engine/attention/mla.py) against multi-head attention over the
full keys and values the latents stand for, in float64."""

from __future__ import annotations

import pytest
import torch

from shardline.engine.attention.mla import latent_paged_attention, split_up_projection, write_latent

HEADS, NOPE, ROPE, VALUE, RANK, BLOCK = 3, 8, 4, 6, 10, 4


def full_attention(q_nope, q_rope, latent, rope_key, kv_b_weight, scale):
    """The keys and values up-projected the way deepseek's attention builds them (kv_b_proj
    on the latent, per head key then value rows; the rotary key repeated per head), then
    SDPA with the last queries aligned to the last keys."""
    seq_len, num_queries = latent.shape[0], q_nope.shape[0]
    kv = (latent @ kv_b_weight.T).view(seq_len, HEADS, NOPE + VALUE)
    key = torch.cat([kv[..., :NOPE], rope_key[:, None, :].expand(seq_len, HEADS, ROPE)], dim=-1)
    query = torch.cat([q_nope, q_rope], dim=-1)
    mask = torch.ones(num_queries, seq_len, dtype=torch.bool).tril(diagonal=seq_len - num_queries)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), kv[..., NOPE:].transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("absorb_up_to", [0, 1, 100])
def test_latent_attention_matches_full_keys_and_values(absorb_up_to: int) -> None:
    generator = torch.Generator().manual_seed(absorb_up_to)
    seq_lens, query_lens = [9, 1, 13, 5], [3, 1, 1, 5]  # a chunk, two decodes, a whole prompt
    num_blocks = 16
    kv_b_weight = torch.randn(HEADS * (NOPE + VALUE), RANK, generator=generator, dtype=torch.float64)
    cache = torch.zeros(num_blocks, BLOCK, RANK + ROPE, dtype=torch.float64)
    order = torch.randperm(num_blocks - 1, generator=generator) + 1  # scattered blocks, none is 0
    tables = torch.zeros(len(seq_lens), 4, dtype=torch.int32)
    contexts = []
    for request, seq_len in enumerate(seq_lens):
        blocks = order[: -(-seq_len // BLOCK)]
        order = order[len(blocks):]
        tables[request, : len(blocks)] = blocks.int()
        latent = torch.randn(seq_len, RANK, generator=generator, dtype=torch.float64)
        rope_key = torch.randn(seq_len, ROPE, generator=generator, dtype=torch.float64)
        positions = torch.arange(seq_len)
        write_latent(cache, latent, rope_key, blocks[positions // BLOCK] * BLOCK + positions % BLOCK)
        contexts.append((latent, rope_key))
    num_tokens = sum(query_lens)
    q_nope = torch.randn(num_tokens, HEADS, NOPE, generator=generator, dtype=torch.float64)
    q_rope = torch.randn(num_tokens, HEADS, ROPE, generator=generator, dtype=torch.float64)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    w_uk, w_uv = split_up_projection(kv_b_weight, HEADS, NOPE, VALUE)
    scale = (NOPE + ROPE) ** -0.5

    out = latent_paged_attention(q_nope, q_rope, cache, starts, torch.tensor(seq_lens), tables, w_uk, w_uv,
                                 scale, absorb_up_to=absorb_up_to)

    for request, (latent, rope_key) in enumerate(contexts):
        rows = slice(int(starts[request]), int(starts[request + 1]))
        expected = full_attention(q_nope[rows], q_rope[rows], latent, rope_key, kv_b_weight, scale)
        torch.testing.assert_close(out[rows], expected, rtol=1e-10, atol=1e-10)
    other = latent_paged_attention(q_nope.flip(0), q_rope, cache, starts, torch.tensor(seq_lens), tables,
                                   w_uk, w_uv, scale, absorb_up_to=absorb_up_to)
    assert not torch.allclose(other, out)  # the output depends on the queries


def test_write_latent_places_each_token_at_its_slot() -> None:
    cache = torch.zeros(3, BLOCK, RANK + ROPE)
    latent, rope_key = torch.randn(2, RANK), torch.randn(2, ROPE)
    write_latent(cache, latent, rope_key, torch.tensor([5, 10]))
    torch.testing.assert_close(cache[1, 1], torch.cat([latent[0], rope_key[0]]), rtol=0, atol=0)
    torch.testing.assert_close(cache[2, 2], torch.cat([latent[1], rope_key[1]]), rtol=0, atol=0)
    assert int((cache != 0).sum()) == 2 * (RANK + ROPE)


def test_mismatched_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="kv_b_proj's weight has 40 rows; 3 heads of 8 key and 6 value"):
        split_up_projection(torch.zeros(40, RANK), HEADS, NOPE, VALUE)
    with pytest.raises(ValueError, match="do not fill the latent cache's 15 per token"):
        write_latent(torch.zeros(2, BLOCK, 15), torch.zeros(1, RANK), torch.zeros(1, ROPE), torch.tensor([0]))
