"""Measuring the model's peak GPU memory, to size the KV cache from what is left."""

from __future__ import annotations

import math

import torch

from ..attention.backends import AttentionBackend, StepBatch
from .kv_cache_spec import KVCacheSpec


@torch.inference_mode()
def profile_peak_bytes(model: torch.nn.Module, backend: AttentionBackend, spec: KVCacheSpec, num_tokens: int,
                       block_size: int,
                       device: torch.device, max_model_len: int) -> int:
    """Peak bytes allocated (weights included) by one forward over ``num_tokens``
    tokens, the largest batch the scheduler can build, on a throwaway cache."""
    num_blocks = math.ceil(num_tokens / block_size)
    caches = spec.allocate(num_blocks, block_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    ctx = backend.build_context(StepBatch(
        slot_mapping=torch.arange(num_tokens, device=device),
        query_start_loc=torch.tensor([0, num_tokens], device=device),
        seq_lens=torch.tensor([num_tokens], device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        kv_caches=caches,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    ))
    ids = torch.zeros((1, num_tokens), dtype=torch.int64, device=device)
    positions = (torch.arange(num_tokens, device=device) % max_model_len)[None]
    model(input_ids=ids, position_ids=positions, use_cache=False, shardline_ctx=ctx,
          logits_to_keep=torch.tensor([num_tokens - 1], device=device))
    torch.cuda.synchronize(device)
    cache_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in caches)
    peak = torch.cuda.max_memory_allocated(device) - cache_bytes
    del caches
    torch.cuda.empty_cache()
    return int(peak)
