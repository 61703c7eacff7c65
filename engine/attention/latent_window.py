"""Which keys a latent attention layer's queries see under a sliding window.

A sliding-window latent layer (dots3_note's "sliding_attention" layers) lets a query at
position p see the keys p - window + 1 .. p. A request's n queries of a step sit at
positions S - n .. S - 1 of its context of S tokens, so no query of the step reads a
key before ``window_start(S, n, window)``: the torch path reads the request's latents
from there on. That is also why the null block of a windowed cache group (the blocks
engine/core/window_blocks.py hands back, below the first key any later query reads) is
never read here.
"""

from __future__ import annotations

import torch


def window_start(seq_len: int, num_queries: int, window: int | None) -> int:
    """The first key position any of the request's last ``num_queries`` queries sees
    (0 without a window)."""
    if window is None:
        return 0
    return max(0, seq_len - num_queries - window + 1)


def visible_keys(num_queries: int, seq_len: int, first: int, window: int | None,
                 selected: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """[n, seq_len - first] bool: which of the keys first .. seq_len - 1 each of the last
    n queries attends: at or before its position, within ``window`` of it, and among
    ``selected`` [n, seq_len] (a sparse attention's selection) where given. None where
    that is plain causal attention over every key (no window cut, no selection)."""
    if window is None or seq_len <= window:
        return selected[:, first:] if selected is not None else None
    query_pos = torch.arange(seq_len - num_queries, seq_len, device=device)[:, None]
    key_pos = torch.arange(first, seq_len, device=device)[None, :]
    visible = (key_pos <= query_pos) & (query_pos - key_pos < window)
    return visible & selected[:, first:] if selected is not None else visible
