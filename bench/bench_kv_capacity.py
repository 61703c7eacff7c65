"""KV capacity: how many requests with long prompts are resident at once in one cache
budget, through the engine's scheduler and block allocator: for Gemma-3-shaped models
(five sliding-window layers to one full layer; the 1B shape with window 512, the 4B
shape with window 1024), one block table for all layers against one table per layer
group whose windowed groups drop the blocks no later query reads, the budget split as
the engine plans it (engine/core/window_blocks.py, KVCacheSpec's plan_windowed_blocks);
and for a DeepSeek-V3-shaped model, every head's keys and values against the latent and
rotary key its layers cache (engine/model/adapters/latent.py).

Every request's prompt is computed ``--chunk`` tokens a step and then its first sampled
token, none finishing, until the scheduler admits no more or preempts. The layer specs
are the engine's own (KVCacheSpec.from_hf_config); no model runs.

    python bench/bench_kv_capacity.py [--prompt 4096] [--budget-gib 8] [--mla-budget-gib 64]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import transformers

from shardline.engine.core.kv_cache import KVCacheManager
from shardline.engine.core.request import Request
from shardline.engine.core.scheduler import Scheduler, SchedulerConfig
from shardline.engine.core.window_blocks import WindowedLayout
from shardline.engine.model.adapters.latent import caches_latents
from shardline.engine.model.kv_cache_spec import KVCacheSpec, LayerCacheSpec, plan_windowed_blocks

# Gemma 3's attention: (layers, query heads, key-value heads, window); head_dim 256, every sixth layer full.
GEMMA3_SHAPES = {"1b": (26, 4, 1, 512), "4b": (34, 8, 4, 1024)}


def gemma3_config(shape: str) -> transformers.Gemma3TextConfig:
    layers, heads, kv_heads, window = GEMMA3_SHAPES[shape]
    return transformers.Gemma3TextConfig(num_hidden_layers=layers, hidden_size=256 * heads,
                                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256,
                                         intermediate_size=1024, vocab_size=1024, sliding_window=window)


def resident_requests(scheduler: Scheduler, prompt_len: int, num_requests: int) -> int:
    """The most requests running at once while each computes its prompt and first
    sampled token (none finishing), until one waits with nothing left to schedule or
    the scheduler preempts."""
    for index in range(num_requests):
        scheduler.add_request(Request(str(index), [3 + index % 1000] * prompt_len, max_tokens=1_000_000))
    most = 0
    while scheduler.waiting and not scheduler.num_preemptions:
        output = scheduler.schedule()
        if output.is_empty:
            break
        for item in output.scheduled:
            if item.is_last_chunk and not item.request.num_output_tokens:
                item.request.append_output_token(5)
        most = max(most, len(scheduler.running))
    return most


def gemma3_capacity(shape: str, prompt_len: int, chunk: int, block_size: int, budget: int,
                    max_num_seqs: int) -> dict[str, object]:
    spec = KVCacheSpec.from_hf_config(gemma3_config(shape), torch.bfloat16)
    model_len = prompt_len + block_size

    def scheduler(num_blocks: int, windowed: WindowedLayout | None = None) -> Scheduler:
        return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk,
                                         max_model_len=model_len, block_size=block_size, num_blocks=num_blocks,
                                         enable_prefix_caching=False, prefix_aware_admission=False,
                                         windowed=windowed))

    one_table = scheduler(budget // spec.bytes_per_block(block_size))
    before = resident_requests(one_table, prompt_len, max_num_seqs)
    planned = plan_windowed_blocks(spec, block_size, max_num_seqs, model_len, chunk, budget)
    assert planned is not None, "the budget holds no request in every group"
    primary_blocks, layout = planned
    per_group = scheduler(primary_blocks, layout)
    after = resident_requests(per_group, prompt_len, max_num_seqs)
    window = GEMMA3_SHAPES[shape][3]
    return {"model": f"gemma3-{shape}-shaped ({spec.num_layers} layers, window {window})", "prompt": prompt_len,
            "chunk": chunk, "budget_gib": budget / 2**30, "one_table": before, "per_group": after,
            "ratio": round(after / before, 2) if before else None}


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


def deepseek_v3_capacity(prompt_len: int, chunk: int, block_size: int, budget: int) -> dict[str, object]:
    """transformers' DeepseekV3Config defaults are DeepSeek-V3's shape (61 layers, 128 heads,
    kv_lora_rank 512, keys of 128 + 64, values of 128)."""
    config = transformers.DeepseekV3Config()
    assert caches_latents(config), "deepseek_v3 caches latents (see latent_cache_refusal)"
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
    parser.add_argument("--shape", nargs="+", default=list(GEMMA3_SHAPES), choices=list(GEMMA3_SHAPES))
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--mla-budget-gib", type=float, default=64.0)
    args = parser.parse_args()
    budget = int(args.budget_gib * 2**30)
    for shape in args.shape:
        print(json.dumps(gemma3_capacity(shape, args.prompt, args.chunk, args.block_size, budget,
                                         args.max_num_seqs)))
    print(json.dumps(deepseek_v3_capacity(args.prompt, args.chunk, args.block_size, int(args.mla_budget_gib * 2**30))))


if __name__ == "__main__":
    main()
