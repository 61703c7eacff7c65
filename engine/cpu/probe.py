"""The probe step a CPU replacement is checked on before it goes in: one fresh request of
PROBE_TOKENS tokens at positions 3.., on throwaway paged caches of one 16-slot block,
through the engine's torch attention backend (engine/surgery.py's probe_matches runs
the original and the replacement on it)."""

from __future__ import annotations

import torch
from torch import nn

from ..attention.backends import StepBatch, TorchBackend
from ..attention.context import AttentionContext

PROBE_TOKENS = 6


def probe_cache(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's zeroed (key cache, value cache) of one block."""
    shape = (1, 16, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def probe_positions() -> torch.Tensor:
    return torch.arange(3, 3 + PROBE_TOKENS)[None]


def probe_context(caches: list[tuple[torch.Tensor, torch.Tensor]], num_heads: int) -> AttentionContext:
    """The probe request's attention context over ``caches`` (each layer's, by index)."""
    tokens = PROBE_TOKENS
    return TorchBackend(num_heads).build_context(StepBatch(
        slot_mapping=torch.arange(tokens), query_start_loc=torch.tensor([0, tokens]),
        seq_lens=torch.tensor([tokens]), block_tables=torch.zeros((1, 1), dtype=torch.int32),
        kv_caches=caches, max_query_len=tokens, max_seq_len=tokens))


def probe_layer(layer: nn.Module, rotary_emb: nn.Module, hidden_size: int, dtype: torch.dtype,
                ctx: AttentionContext) -> torch.Tensor:
    """A decoder layer's (or its replacement's) output for the probe request's hidden
    states (random, seeded) in ``ctx``."""
    hidden = torch.randn(1, PROBE_TOKENS, hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    positions = probe_positions()
    return layer(hidden, attention_mask=None, position_ids=positions,
                 position_embeddings=rotary_emb(hidden, positions), shardline_ctx=ctx)
