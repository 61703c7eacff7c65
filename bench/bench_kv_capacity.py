"""KV capacity: how many requests with long prompts are resident at once in one cache
budget, with one block table for all layers (engine/core/kv_cache.py) against one
table per layer group whose windowed groups drop the blocks no later query reads
(engine/core/window_blocks.py), for a Gemma-3-shaped model (five sliding-window
layers to one full layer); and for a DeepSeek-V3-shaped model, every head's keys and
values against the latent and rotary key its layers cache (engine/model/adapters/latent.py).

Each request's prompt is computed ``--chunk`` tokens at a time and then takes its first
decode slot; requests are admitted until the cache refuses one, none finishing. The
layer specs are the engine's own (KVCacheSpec.from_hf_config); no model runs.

    python bench/bench_kv_capacity.py [--prompt 4096] [--budget-gib 8] [--window 1024] [--mla-budget-gib 64]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import transformers

from shardline.engine.core.kv_cache import KVCacheManager
from shardline.engine.core.request import Request
from shardline.engine.core.window_blocks import WindowedBlockTables, layer_groups, split_budget
from shardline.engine.model.adapters.latent import caches_latents
from shardline.engine.model.kv_cache_spec import KVCacheSpec, LayerCacheSpec


# Gemma-3-4B's attention: 34 layers, every sixth full, 4 key-value heads of 256.
def gemma3_config(window: int) -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(num_hidden_layers=34, hidden_size=2560, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=256, intermediate_size=10240,
                                         vocab_size=1024, sliding_window=window)


def count_resident(allocate: Callable[[Request, int], bool], prompt_len: int, chunk: int) -> int:
    """Requests admitted (whole prompt computed, first decode slot taken) before
    ``allocate`` refuses one."""
    admitted = 0
    while True:
        request = Request(str(admitted), [3] * prompt_len, max_tokens=1)
        while request.num_computed_tokens < prompt_len:
            step = min(chunk, prompt_len - request.num_computed_tokens)
            if not allocate(request, step):
                return admitted
            request.num_computed_tokens += step
        if not allocate(request, 1):
            return admitted
        admitted += 1


def gemma3_capacity(window: int, prompt_len: int, chunk: int, block_size: int, budget: int,
                    max_num_seqs: int) -> dict[str, object]:
    spec = KVCacheSpec.from_hf_config(gemma3_config(window), torch.bfloat16)
    one_table = KVCacheManager(budget // spec.bytes_per_block(block_size), block_size, enable_prefix_caching=False)
    before = count_resident(lambda request, new: one_table.allocate_slots(request, new), prompt_len, chunk)

    layers = spec.layers
    groups = layer_groups([(layer.kind, layer.sliding_window or layer.chunk_size) for layer in layers])
    element = torch.empty((), dtype=spec.dtype).element_size()
    group_bytes = [element * sum(layers[index].elements_per_block(block_size) for index in group.layers)
                   for group in groups]
    num_blocks = split_budget(groups, group_bytes, budget, block_size, prompt_len + 1, chunk, max_num_seqs)
    assert sum(count * size for count, size in zip(num_blocks, group_bytes, strict=True)) <= budget + sum(group_bytes)
    tables = WindowedBlockTables(groups, num_blocks, block_size)
    after = count_resident(tables.allocate_slots, prompt_len, chunk)
    return {"model": f"gemma3-shaped ({len(layers)} layers, window {window})", "prompt": prompt_len,
            "chunk": chunk, "budget_gib": budget / 2**30, "one_table": before, "per_group": after,
            "ratio": round(after / before, 2) if before else None}


def deepseek_v3_capacity(prompt_len: int, chunk: int, block_size: int, budget: int) -> dict[str, object]:
    """transformers' DeepseekV3Config defaults are DeepSeek-V3's shape (61 layers, 128 heads,
    kv_lora_rank 512, keys of 128 + 64, values of 128)."""
    config = transformers.DeepseekV3Config()
    assert caches_latents(config), "latents are cached on hosts without CUDA"
    latent = KVCacheSpec.from_hf_config(config, torch.bfloat16)
    key_size, value_size = config.qk_nope_head_dim + config.qk_rope_head_dim, int(config.v_head_dim or 0)
    full = KVCacheSpec(tuple(LayerCacheSpec(layer.kind, config.num_attention_heads, key_size, value_size)
                             for layer in latent.layers), latent.dtype)
    counts = {}
    for name, spec in (("full_keys_values", full), ("latent", latent)):
        manager = KVCacheManager(budget // spec.bytes_per_block(block_size), block_size, enable_prefix_caching=False)
        counts[name] = count_resident(lambda request, new, m=manager: m.allocate_slots(request, new), prompt_len, chunk)
    before, after = counts["full_keys_values"], counts["latent"]
    return {"model": f"deepseek_v3-shaped ({len(latent.layers)} layers)", "prompt": prompt_len, "chunk": chunk,
            "budget_gib": budget / 2**30, **counts, "ratio": round(after / before, 2) if before else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or '').splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--window", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--mla-budget-gib", type=float, default=64.0)
    args = parser.parse_args()
    budget = int(args.budget_gib * 2**30)
    for window in args.window:
        print(json.dumps(gemma3_capacity(window, args.prompt, args.chunk, args.block_size, budget,
                                         args.max_num_seqs)))
    print(json.dumps(deepseek_v3_capacity(args.prompt, args.chunk, args.block_size, int(args.mla_budget_gib * 2**30))))


if __name__ == "__main__":
    main()
