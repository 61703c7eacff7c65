"""Throughput from the batch's shape: prefix-aware admission and duplicate rows run once.

The workload is a shard mixing tasks: several instruction + few-shot prefixes of a few
hundred tokens, rows of the different templates interleaved at random, each with a
short tail of its own, a share of rows repeating an earlier row exactly, and a few
output tokens (greedy). The KV cache holds only a few of the prefixes at once. Three
engines over the same Llama-shaped random-weight model (bench/common.py) run the same
rows side by side in one process, each starting with a cold prefix cache:

- "every token": prefix caching off, arrival order, no collapsing, over the first
  ``--rate-rows`` rows: the engine's rate at computing prompt tokens (output tokens
  included) on this workload, for the bound below;
- "default before": prefix caching on, arrival order, no collapsing (the engine's
  default before prefix-aware admission and duplicate collapsing; its prefix hits are
  token-granular as the engine's now are, so the ratio to it is the smaller one);
- "batch-aware": the default now (prefix-aware admission, duplicates run once).

The prefill-token bound is the time "every token" would take to compute only the
distinct prompt tokens (every row's prompt tokens counted once per distinct prefix
position: shared prefixes and repeated rows are free) at its rate; the batch-aware
run reaches bound_time / its_time of it. Outputs are checked token for token
between the engines (over the rows each ran).

``--cpu-time`` runs on one thread timed by its CPU time, so the ratios hold on a
machine other work is loading (the absolute figures are then one core's).

    python bench/bench_batch_shape.py [--rows 256] [--templates 8] [--prefix-len 200 400]
        [--tail-len 4 24] [--duplicates 0.3] [--output-len 4] [--cached-prefixes 3] [--rate-rows 48]
        [--block-size 16] [--repeat 1] [--cpu-time]

Prefix hits are token-granular: a row whose template ends inside a block copies that
block's template tokens from a block holding them (engine/core/partial_blocks.py)
instead of computing them again, so ``--block-size`` (the engine's default is 16)
moves the batch-aware run's distance to the token bound little.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
from common import build_bench_model, run_clock

from shardline import LLM, SamplingParams
from shardline.engine.config import EngineConfig
from shardline.engine.cpu.capability import host_cpu
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.loader import load_hf_config

# What the runs are timed by: the wall clock, or with --cpu-time the thread's CPU time.
clock: Callable[[], float] = time.perf_counter
VOCAB_SIZE = 16384
ENGINES = {
    "every token": dict(enable_prefix_caching=False, prefix_aware_admission=False, collapse_duplicate_requests=False),
    "default before": dict(prefix_aware_admission=False, collapse_duplicate_requests=False),
    "batch-aware": {},
}


def mixed_template_rows(args: argparse.Namespace) -> list[list[int]]:
    """Rows of ``args.templates`` prefixes interleaved at random, a tail each, and
    ``args.duplicates`` of them repeating an earlier row."""
    rng = random.Random(args.seed)
    templates = [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(*args.prefix_len))]
                 for _ in range(args.templates)]
    rows: list[list[int]] = []
    for _ in range(args.rows):
        if rows and rng.random() < args.duplicates:
            rows.append(list(rng.choice(rows)))
            continue
        tail = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(*args.tail_len))]
        rows.append(rng.choice(templates) + tail)
    return rows


def distinct_tokens(rows: list[list[int]]) -> int:
    """Prompt tokens counted once per distinct prefix (the nodes of the rows' trie)."""
    root: dict = {}
    count = 0
    for row in rows:
        node = root
        for token in row:
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                count += 1
            node = child
    return count


def run(llm: LLM, rows: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """Seconds to generate every row from a cold prefix cache, and the rows' tokens."""
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = clock()
    outputs = llm.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False)
    elapsed = clock() - start
    return elapsed, [output.outputs[0].token_ids for output in outputs]


def engine_of(llm: LLM) -> LLMEngine:
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--templates", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, nargs=2, default=(200, 400))
    parser.add_argument("--tail-len", type=int, nargs=2, default=(4, 24))
    parser.add_argument("--duplicates", type=float, default=0.3, help="share of rows repeating an earlier row")
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--cached-prefixes", type=float, default=3.0,
                        help="KV cache size in longest prefixes (plus one block per running sequence)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds; best of each compared")
    parser.add_argument("--rate-rows", type=int, default=48, help="rows 'every token' runs to measure its rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time")
    args = parser.parse_args()
    global clock
    clock = run_clock(args.cpu_time)

    model_dir = build_bench_model()
    rows = mixed_template_rows(args)
    total, distinct = sum(len(row) for row in rows), distinct_tokens(rows)
    spec = KVCacheSpec.from_hf_config(load_hf_config(EngineConfig(model=model_dir)), torch.float32)
    block_size = args.block_size
    num_blocks = int(args.cached_prefixes * -(-args.prefix_len[1] // block_size)) + args.max_num_seqs * 16 // block_size
    max_model_len = args.prefix_len[1] + args.tail_len[1] + args.output_len
    llms = {name: LLM(model_dir, dtype="float32", device=args.device, block_size=block_size,
                      max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                      kv_cache_memory_bytes=num_blocks * spec.bytes_per_block(block_size), **options)
            for name, options in ENGINES.items()}
    for llm in llms.values():  # warm up outside the timed runs
        llm.generate({"prompt_token_ids": rows[0][:16]}, SamplingParams(max_tokens=2), use_tqdm=False)

    seconds: dict[str, list[float]] = {name: [] for name in llms}
    tokens: dict[str, list[list[int]]] = {}
    rate_rows = rows[: args.rate_rows]
    for _ in range(args.repeat):  # interleaved, so a slow phase of the machine hits every engine
        for name, llm in llms.items():
            with torch.inference_mode():
                elapsed, tokens[name] = run(llm, rate_rows if name == "every token" else rows, args.output_len)
            seconds[name].append(elapsed)
    assert tokens["default before"] == tokens["batch-aware"], "batch-aware outputs differ from arrival order's"
    assert tokens["every token"] == tokens["batch-aware"][: len(rate_rows)], "outputs differ from every token's"
    assert len({tuple(t) for t in tokens["every token"]}) > 1, "the outputs do not depend on the rows"

    print(f"host: {host_cpu().describe()}; device {args.device}; {torch.get_num_threads()} threads")
    print(f"workload: {args.rows} rows, {args.templates} templates of {args.prefix_len[0]}-{args.prefix_len[1]} "
          f"tokens, tails of {args.tail_len[0]}-{args.tail_len[1]}, {args.duplicates:.0%} repeated rows, "
          f"{args.output_len} output tokens, greedy float32; KV cache {num_blocks} blocks of {block_size} "
          f"(about {args.cached_prefixes:g} longest prefixes and 16 tokens a sequence), "
          f"max_num_seqs {args.max_num_seqs}")
    print(f"prompt tokens: {total} in all, {distinct} distinct: prefill-token bound {total / distinct:.2f}x")
    best = {name: min(runs) for name, runs in seconds.items()}
    for name, llm in llms.items():
        stats = engine_of(llm).stats()
        num_rows = len(rate_rows) if name == "every token" else len(rows)
        hit_rate = "off" if stats.prefix_cache_hit_rate is None else f"{stats.prefix_cache_hit_rate:.2f}"
        prefix_stats = engine_of(llm).scheduler.kv_cache.stats
        computed = (prefix_stats.num_query_tokens - prefix_stats.num_hit_tokens if prefix_stats.num_queries
                    else sum(len(row) for row in rate_rows))
        print(f"{name:15s} {num_rows:5d} rows {best[name]:8.2f} s  {num_rows / best[name]:8.2f} rows/s  "
              f"steps {stats.num_steps}  prompt tokens computed {computed}  prefix hit rate {hit_rate}  "
              f"partial-block hits {prefix_stats.num_partial_hits}  "
              f"preemptions {stats.num_preemptions}  "
              f"collapsed rows {engine_of(llm).duplicates.num_collapsed}  "
              f"runs: {', '.join(f'{s:.2f}' for s in seconds[name])} s")
    rate = sum(len(row) for row in rate_rows) / best["every token"]
    print(f"every token computes {rate:.0f} prompt tokens/s (its output tokens included)")
    bound_seconds = distinct / rate
    print(f"batch-aware vs default before: {best['default before'] / best['batch-aware']:.2f}x (goal >= 2x)")
    print(f"batch-aware vs the prefill-token bound ({bound_seconds:.2f} s): "
          f"{bound_seconds / best['batch-aware']:.2f} of it (goal >= 0.67)")


if __name__ == "__main__":
    main()
