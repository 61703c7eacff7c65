"""ChunkLayout: every token in exactly one chunk slot of its own request, in order,
and the chunks at each index a slice of the layout."""

import random

import pytest
import torch

from shardline.engine.recurrent.chunk_layout import ChunkLayout


@pytest.mark.parametrize("seed", range(4))
def test_layout_places_each_token_once_in_its_requests_chunks(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
    chunk_size = rng.choice([1, 4, 7, 16])
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    num_tokens = sum(lengths)
    layout = ChunkLayout(cu_seqlens, chunk_size, num_tokens)

    tokens = torch.arange(num_tokens, dtype=torch.float64) + 1
    chunks = layout.gather(tokens[:, None])[..., 0]  # [N, C]
    assert torch.equal(layout.scatter(chunks[..., None])[:, 0], tokens)
    assert torch.equal(chunks == 0, ~layout.valid)  # padding slots gather zeros
    for chunk in range(layout.num_chunks):
        request, position = int(layout.request[chunk]), int(layout.position[chunk])
        first = int(cu_seqlens[request]) + position * chunk_size
        expected = [t for t in range(first, first + chunk_size) if t < int(cu_seqlens[request + 1])]
        assert layout.token_index[chunk][layout.valid[chunk]].tolist() == expected
    seen = []
    for position in range(layout.max_chunks):
        at = layout.chunks_at(position)
        assert (layout.position[at] == position).all()
        # ranks [0, active): the first requests of ``order`` in the layout's order
        assert layout.request[at].tolist() == layout.order[: at.stop - at.start].tolist()
        seen += range(at.start, at.stop)
    assert seen == list(range(layout.num_chunks))


def test_gather_heads_is_the_head_major_gather_at_valid_slots():
    cu_seqlens = torch.tensor([0, 5, 6, 23])
    layout = ChunkLayout(cu_seqlens, 4, 23)
    packed = torch.randn(23, 3, 2, generator=torch.Generator().manual_seed(0))
    heads = layout.gather_heads(packed)  # [N, H, C, D]
    assert heads.is_contiguous() and torch.isfinite(heads).all()
    expected = layout.gather(packed).transpose(1, 2)
    valid = layout.valid[:, None, :, None].expand_as(heads)
    assert torch.equal(heads[valid], expected[valid])
