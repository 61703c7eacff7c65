"""Attention over a sliding window of raw keys plus keys pooled over blocks of tokens
(DeepSeek-V4's compressed attention), on the engine's paged cache, in plain torch.

A compressed layer attends, for a query at position p, the raw keys at positions
p - window + 1 .. p and the compressed entries whose block of ``rate`` tokens ends at or
before p (entry w pools tokens w * rate .. w * rate + rate - 1, so it is visible from
position (w + 1) * rate - 1 on: w < (p + 1) // rate). A heavily compressed layer (HCA)
attends every visible entry; a compressed sparse layer (CSA) attends the top
``index_topk`` visible entries by its indexer's scores (all of them where fewer are
visible), as transformers' indexer ranks them. Keys are values too (one shared head),
and learned sinks join each head's softmax.

Cache (one layer, beside its raw keys in the key cache): each token's value-cache row
holds the compressors' per-token projections (kv and gate, for its own block and, in a
CSA layer, the overlap half read by the next block) and, at the last token of each
block, the block's compressed entry; a CSA layer adds its indexer's projections and
index entry. A block's entry is written by the step that computes its last token,
from the cached projections of its tokens (and the previous block's): a block split
by chunked prefill or decode steps is pooled once it is whole, and cached blocks
restored by a prefix hit carry their entries and projections alike.

Invariants (what transformers computes, kept exactly):
- entry w pools with softmax over the block's slots (float32) of gate + position_bias,
  per channel; a CSA entry pools 2 * rate slots, the previous block's first-half
  channels then its own block's second-half ones (block 0: the first half is absent);
- the indexer's scores are float32: sum over heads of relu(q_h . k) * scale * weight_h;
  the selection is ``torch.topk`` over the visible entries. Ties at the boundary would
  make it depend on topk's order among equal scores; the tests build tiny models whose
  scores do not tie there and check it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PooledSeries:
    """One compressor's per-token slice of a value-cache row: ``width`` numbers per
    entry, ``overlap`` (CSA): each token projects 2 * width (the next block's half, then
    its own block's); the row holds kv, gate (each ``parts`` * width), then the entry."""

    offset: int
    width: int
    overlap: bool

    @property
    def parts(self) -> int:
        return 2 if self.overlap else 1

    @property
    def row_width(self) -> int:
        return 2 * self.parts * self.width + self.width

    def projections(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv, gate) [P, parts * width] of cached rows [P, row]."""
        span = self.parts * self.width
        return rows[:, self.offset:self.offset + span], rows[:, self.offset + span:self.offset + 2 * span]

    def entry_slice(self) -> slice:
        start = self.offset + 2 * self.parts * self.width
        return slice(start, start + self.width)


def pack_rows(series: list[PooledSeries], projections: list[tuple[torch.Tensor, torch.Tensor]],
              row_width: int) -> torch.Tensor:
    """The step's value-cache rows [T, row_width]: each series' (kv, gate) projections,
    entries left zero (written once their block is whole)."""
    num_tokens = projections[0][0].shape[0]
    rows = projections[0][0].new_zeros(num_tokens, row_width)
    for part, (kv, gate) in zip(series, projections, strict=True):
        span = part.parts * part.width
        rows[:, part.offset:part.offset + span] = kv
        rows[:, part.offset + span:part.offset + 2 * span] = gate
    return rows


def pool_blocks(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, rate: int,
                first_block: int, num_blocks: int, overlap: bool) -> torch.Tensor:
    """The un-normalized entries [n, width] of blocks first_block .. first_block + n - 1
    from the per-token projections kv, gate [P, parts * width] of positions
    (first_block - 1) * rate .. (first_block + n) * rate - 1 (without the leading block
    where first_block is 0, or where the series has no overlap)."""
    if not overlap:
        blocks_kv = kv.view(num_blocks, rate, -1)
        blocks_gate = gate.view(num_blocks, rate, -1) + position_bias
        return (blocks_kv * blocks_gate.softmax(dim=1, dtype=torch.float32).to(blocks_kv.dtype)).sum(dim=1)
    width = kv.shape[-1] // 2
    leading = 1 if first_block > 0 else 0
    all_kv = kv.view(num_blocks + leading, rate, 2 * width)
    all_gate = gate.view(num_blocks + leading, rate, 2 * width) + position_bias
    pooled_kv = all_kv.new_zeros(num_blocks, 2 * rate, width)
    pooled_gate = all_gate.new_full((num_blocks, 2 * rate, width), float("-inf"))
    pooled_kv[:, rate:] = all_kv[leading:, :, width:]
    pooled_gate[:, rate:] = all_gate[leading:, :, width:]
    if leading:
        pooled_kv[:, :rate] = all_kv[:-1, :, :width]
        pooled_gate[:, :rate] = all_gate[:-1, :, :width]
    elif num_blocks > 1:
        pooled_kv[1:, :rate] = all_kv[:-1, :, :width]
        pooled_gate[1:, :rate] = all_gate[:-1, :, :width]
    return (pooled_kv * pooled_gate.softmax(dim=1, dtype=torch.float32).to(pooled_kv.dtype)).sum(dim=1)


def visible_entries(positions: torch.Tensor, rate: int, num_entries: int) -> torch.Tensor:
    """[n, E] bool: entry w is visible to a query at position p when w < (p + 1) // rate."""
    limits = (positions + 1) // rate
    return torch.arange(num_entries, device=positions.device)[None, :] < limits[:, None]


def select_entries(q_index: torch.Tensor, head_weights: torch.Tensor, index_entries: torch.Tensor,
                   positions: torch.Tensor, rate: int, topk: int, scale: float) -> torch.Tensor:
    """[n, E] bool: each query's top-``topk`` visible entries by the indexer's score
    (q_index [n, H, D] rotated, head_weights [n, H] float32 already scaled,
    index_entries [E, D])."""
    scores = torch.matmul(q_index.float(), index_entries.float().transpose(0, 1))  # [n, H, E]
    scores = (torch.relu(scores) * scale * head_weights[:, :, None]).sum(dim=1)  # [n, E]
    visible = visible_entries(positions, rate, index_entries.shape[0])
    masked = scores.masked_fill(~visible, float("-inf"))
    chosen = masked.topk(min(topk, index_entries.shape[0]), dim=-1).indices
    return torch.zeros_like(visible).scatter_(-1, chosen, True) & visible


def attend_window_and_entries(query: torch.Tensor, keys: torch.Tensor, key_positions: torch.Tensor,
                              entries: torch.Tensor, entry_mask: torch.Tensor, positions: torch.Tensor,
                              window: int, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """One request's attention: query [n, H, D] at ``positions`` [n] over the raw keys
    [S, D] at key_positions [S] within the window and the entries [E, D] entry_mask
    [n, E] marks, keys doubling as values, with one sink logit per head; -> [n, H, D]."""
    offsets = positions[:, None] - key_positions[None, :]  # [n, S]
    raw_visible = (offsets >= 0) & (offsets < window)
    values = torch.cat([keys, entries], dim=0)  # [S + E, D]
    visible = torch.cat([raw_visible, entry_mask], dim=1)  # [n, S + E]
    logits = torch.matmul(query, values.transpose(0, 1)) * scale  # [n, H, S + E]
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.to(logits.dtype)[None, :, None].expand(logits.shape[0], -1, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(values.dtype)
    return torch.matmul(probs, values)


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Store rows [T, W] into cache [N, bs, 1, W] at slots [T] (block_id * bs + offset)."""
    width = cache.shape[-1] * cache.shape[-2]
    if rows.shape[-1] != width:
        raise ValueError(f"rows of {rows.shape[-1]} numbers do not fit the cache's {width} per token")
    cache.view(-1, width).index_copy_(0, slots, rows.to(cache.dtype))


def read_rows(cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """One request's rows [end - start, W] of positions start .. end - 1, read through
    its block table."""
    block_size, width = cache.shape[1], cache.shape[-1] * cache.shape[-2]
    first, last = start // block_size, -(-end // block_size)
    blocks = cache.index_select(0, block_table[first:last].long()).reshape(-1, width)
    return blocks[start - first * block_size:end - first * block_size]


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slots [n] of a request's positions [n]."""
    return block_table.long()[positions // block_size] * block_size + positions % block_size
