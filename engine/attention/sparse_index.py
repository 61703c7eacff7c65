"""A sparse attention's indexer over a paged cache of index keys, in plain torch.

DeepSeek Sparse Attention (deepseek_v32, glm_moe_dsa, axk2) adds to each latent
attention layer a small "lightning" indexer: every token writes one index key
(``index_head_dim`` numbers, shared by the indexer's heads) and every query scores the
keys it may see,

    score(q, t) = sum_h w_h(q) * relu(scale * q_h . k_t),

keeping the ``index_topk`` best; the layer's attention then attends those keys alone.
The index keys live in the layer's paged cache beside its latents (the layer's second
cache tensor, [num_blocks, block_size, 1, index_head_dim]: where other layers keep
values), so they are written with the step's slot mapping, planned in the KV budget,
and come back with cached blocks on a prefix hit, like the latents.

Invariants (what transformers' indexer computes, kept exactly):
- scores are float32 whatever the model's dtype (transformers casts q and k with
  ``.float()``), one matmul over the heads then one over the head weights;
- a query sees the keys at or before its own position; where it sees no more than
  ``index_topk`` keys, it selects them all, so such a query attends causally and needs
  no scores (``select_keys`` returns None for a request whose every query is so);
- otherwise the selection is ``torch.topk`` of the scores over the keys it sees. Ties
  at the boundary would make the selection depend on topk's order among equal scores;
  the tests build tiny models whose scores do not tie there, and check it.
"""

from __future__ import annotations

import torch

# A request's selection: [n_queries, seq_len] bool, True at the keys a query attends
# (only keys at or before its position); None where each query attends every key it sees.
Selection = torch.Tensor | None


def write_index_keys(index_cache: torch.Tensor, index_keys: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's index keys [T, D] into index_cache [N, bs, 1, D] at
    slot_mapping [T] (block_id * bs + offset)."""
    width = index_cache.shape[-1] * index_cache.shape[-2]
    if index_keys.shape[-1] != width:
        raise ValueError(f"index keys of {index_keys.shape[-1]} numbers do not fit the index-key cache's "
                         f"{width} per token")
    index_cache.view(-1, width).index_copy_(0, slot_mapping, index_keys.to(index_cache.dtype))


def _context_keys(index_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One request's [seq_len, D] index keys, read through its block table."""
    block_size, width = index_cache.shape[1], index_cache.shape[-1] * index_cache.shape[-2]
    blocks = index_cache.index_select(0, block_table[: -(-seq_len // block_size)].long())
    return blocks.reshape(-1, width)[:seq_len]


def index_scores(q_index: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """The indexer's scores of n queries over S keys: q_index [n, H, D], head_weights
    [n, H] (float32, already scaled), keys [S, D] -> [n, S] float32."""
    scores = torch.relu(torch.matmul(q_index.float(), keys.float().transpose(0, 1)) * scale)  # [n, H, S]
    return torch.matmul(head_weights.float()[:, None, :], scores)[:, 0]


def top_keys(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[n, S] bool: each query's ``topk`` best keys among those at or before its
    position (query i of n sits at position S - n + i)."""
    num_queries, seq_len = scores.shape
    positions = torch.arange(seq_len - num_queries, seq_len, device=scores.device)[:, None]
    hidden = torch.arange(seq_len, device=scores.device)[None, :] > positions
    masked = scores.masked_fill(hidden, float("-inf"))
    chosen = masked.topk(min(topk, seq_len), dim=-1).indices
    selected = torch.zeros_like(hidden).scatter_(-1, chosen, True)
    return selected & ~hidden


def select_keys(q_index: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                topk: int, scale: float) -> list[Selection]:
    """Each request's selection (see ``Selection``) for the packed queries q_index
    [T, H, D] with head_weights [T, H], over its index keys in index_cache; None for a
    request of at most ``topk`` keys (its queries select every key they see)."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    selections: list[Selection] = []
    for request, seq_len in enumerate(lens):
        first, end = starts[request], starts[request + 1]
        if seq_len <= topk or end == first:
            selections.append(None)
            continue
        keys = _context_keys(index_cache, block_tables[request], seq_len)
        scores = index_scores(q_index[first:end], head_weights[first:end], keys, scale)
        selections.append(top_keys(scores, topk))
    return selections

