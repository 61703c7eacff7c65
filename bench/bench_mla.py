"""Decode speed of one multi-head latent attention layer (DeepSeek-V3's head sizes:
latent 512, rotary key 64, key 128 + 64 and value 128 per head), full keys and values
against cached latents, side by side in one process.

A decode step attends each running request's one new query over its whole context:
- full K/V: the paged cache holds every head's key and value (what a latent model
  caches when its layers keep full keys and values): the new tokens' latents
  up-projected by kv_b_proj (their keys and values to write), then the CPU decode
  kernel (kernels/cpu_attention.py) attends;
- latent, C kernel: the cache holds [latent, rotary key] per token; the query is
  absorbed (q_nope W_UK), kernels/cpu_mla.py attends, W_UV maps back
  (engine/attention/mla.py's decode kernel path);
- latent, torch: the same through mla.py's torch einsums (the decode kernel path off).

Prints the step time of each (one thread, CPU time with --cpu-time), their ratios, the
cache bytes per token and the three outputs' largest difference.

    python bench/bench_mla.py [--heads 16] [--requests 8] [--context 2048] [--repeats 5] [--cpu-time]
"""

from __future__ import annotations

import argparse
import json

import torch
from common import run_clock

from shardline.engine.attention.mla import latent_paged_attention
from shardline.engine.kernels.cpu_attention import decode_attention, decode_kernel_available
from shardline.engine.kernels.cpu_mla import mla_decode_available

RANK, ROPE, NOPE, VALUE, BLOCK = 512, 64, 128, 128, 16


def build(heads: int, requests: int, context: int, seed: int = 0) -> dict:
    """Random latents, their full keys and values, paged the same way, a query and
    the new tokens' latents."""
    generator = torch.Generator().manual_seed(seed)
    blocks_each = -(-context // BLOCK)
    num_blocks = requests * blocks_each
    order = torch.randperm(num_blocks, generator=generator)
    tables = order.view(requests, blocks_each).to(torch.int32).contiguous()
    kv_b = torch.randn(heads * (NOPE + VALUE), RANK, generator=generator) * RANK ** -0.5
    latent = torch.randn(num_blocks, BLOCK, RANK, generator=generator)
    rope_key = torch.randn(num_blocks, BLOCK, ROPE, generator=generator)
    kv = (latent @ kv_b.T).view(num_blocks, BLOCK, heads, NOPE + VALUE)
    k_cache = torch.cat([kv[..., :NOPE], rope_key[:, :, None].expand(-1, -1, heads, -1)], dim=-1).contiguous()
    v_cache = kv[..., NOPE:].contiguous()
    q_nope = torch.randn(requests, heads, NOPE, generator=generator)
    q_rope = torch.randn(requests, heads, ROPE, generator=generator)
    w = kv_b.view(heads, NOPE + VALUE, RANK)
    new_latent = torch.randn(requests, RANK, generator=generator)
    return dict(kv_b=kv_b, new_latent=new_latent, latent_cache=torch.cat([latent, rope_key], dim=-1).contiguous(),
                k_cache=k_cache, v_cache=v_cache,
                tables=tables, seq_lens=torch.full((requests,), context, dtype=torch.int64), q_nope=q_nope,
                q_rope=q_rope, w_uk=w[:, :NOPE].contiguous(), w_uv=w[:, NOPE:].contiguous(),
                scale=(NOPE + ROPE) ** -0.5)


def full_step(data: dict) -> torch.Tensor:
    torch.nn.functional.linear(data["new_latent"], data["kv_b"])  # the new tokens' keys and values
    query = torch.cat([data["q_nope"], data["q_rope"]], dim=-1).contiguous()
    requests = torch.arange(query.shape[0], dtype=torch.int64)
    out = query.new_empty((*query.shape[:2], VALUE))
    decode_attention(query, data["k_cache"], data["v_cache"], data["tables"], data["seq_lens"], requests, requests,
                     out, data["scale"])
    return out


def latent_step(data: dict, kernel: bool) -> torch.Tensor:
    starts = torch.arange(data["q_nope"].shape[0] + 1)
    return latent_paged_attention(data["q_nope"], data["q_rope"], data["latent_cache"], starts, data["seq_lens"],
                                  data["tables"], data["w_uk"], data["w_uv"], data["scale"],
                                  decode_kernel="c" if kernel else None)


def timed(step, repeats: int, clock) -> float:
    step()  # warm up (builds the kernels once)
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        step()
        best = min(best, clock() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    clock = run_clock(args.cpu_time)
    data = build(args.heads, args.requests, args.context)
    assert decode_kernel_available(data["k_cache"], args.heads, VALUE), "the CPU decode kernel does not build here"
    assert mla_decode_available(data["latent_cache"]), "the CPU latent decode kernel does not build here"
    outputs = {"full": full_step(data), "latent_kernel": latent_step(data, True),
               "latent_torch": latent_step(data, False)}
    seconds = {"full": timed(lambda: full_step(data), args.repeats, clock),
               "latent_kernel": timed(lambda: latent_step(data, True), args.repeats, clock),
               "latent_torch": timed(lambda: latent_step(data, False), args.repeats, clock)}
    result = {
        "shape": dict(heads=args.heads, requests=args.requests, context=args.context, rank=RANK, rope=ROPE),
        "clock": "thread CPU time, 1 thread" if args.cpu_time else "wall",
        "step_ms": {name: round(value * 1e3, 3) for name, value in seconds.items()},
        "speedup_vs_full": {name: round(seconds["full"] / value, 2) for name, value in seconds.items()},
        "cache_bytes_per_token": {"full": 4 * args.heads * (NOPE + ROPE + VALUE), "latent": 4 * (RANK + ROPE)},
        "max_abs_difference_vs_full": {name: float((out - outputs["full"]).abs().max())
                                       for name, out in outputs.items()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
