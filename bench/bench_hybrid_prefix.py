"""Prefix caching for a hybrid model: the same templated shard with prefix caching on
and off, side by side in one process, each run starting from a cold cache.

The model is bench_hybrid.py's random-weight Qwen3.5-shaped text model (gated delta-net
layers beside full attention). The shard mixes tasks: ``--templates`` instruction +
few-shot prefixes of a few hundred tokens, rows of the different templates
interleaved at random, short row-specific tails, ``--duplicates`` of the rows repeating
an earlier one, and a few output tokens. The KV budget holds only a few of the
prefixes at once (``--budget-prefixes``). Prints rows/s of each run, their ratio, the
prefix-cache hit rate and the prefill-token bound (all rows' prompt tokens over the
distinct tokens among them, counted as distinct block-aligned prefixes).

    python bench/bench_hybrid_prefix.py [--rows 96] [--templates 4] [--output-len 4] [--repeat 1]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from bench_hybrid import HYBRID_BENCH_CONFIG, build_hybrid_model

from shardline import LLM, SamplingParams
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.recurrent.state import RecurrentStateSpec, install_recurrent_layers

BLOCK_SIZE = 16


def templated_rows(num_rows: int, num_templates: int, duplicates: float, seed: int = 0) -> list[list[int]]:
    """Rows of ``num_templates`` prefixes (200-400 tokens), interleaved at random, with
    tails of 8-32 tokens; a ``duplicates`` share repeats an earlier row."""
    rng = random.Random(seed)
    vocab = int(str(HYBRID_BENCH_CONFIG["vocab_size"]))
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randint(200, 400))] for _ in range(num_templates)]
    rows: list[list[int]] = []
    while len(rows) < num_rows:
        if rows and rng.random() < duplicates:
            rows.append(list(rng.choice(rows)))
        else:
            rows.append(rng.choice(prefixes) + [rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))])
    return rows


def distinct_tokens(rows: list[list[int]]) -> int:
    """Tokens a perfect prefix cache computes: each distinct prefix token once."""
    seen: set[tuple[int, ...]] = set()
    for row in rows:
        for end in range(1, len(row) + 1):
            seen.add(tuple(row[:end]))
    return len(seen)


def cache_budget(model_dir: str, prefix_tokens: int, max_num_seqs: int) -> int:
    """Bytes for KV blocks covering ``prefix_tokens`` tokens, max_num_seqs requests'
    recurrent states and the snapshots a quarter of the budget holds (at most
    max_num_seqs), so the blocks left cover ``prefix_tokens`` with prefix caching on."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    per_slot = RecurrentStateSpec.from_layers(install_recurrent_layers(model)).bytes_per_slot()
    per_block = KVCacheSpec.from_hf_config(model.config, torch.float32).bytes_per_block(BLOCK_SIZE)
    base = -(-prefix_tokens // BLOCK_SIZE) * per_block + max_num_seqs * per_slot
    return base + min(max_num_seqs, base // (3 * per_slot)) * per_slot


def run(model_dir: str, rows: list[list[int]], output_len: int, budget: int, max_num_seqs: int,
        prefix_caching: bool) -> tuple[float, list[list[int]], float | None]:
    """(seconds, each row's tokens, hit rate) of one cold-cache run."""
    llm = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, max_model_len=1024, max_num_seqs=max_num_seqs,
              kv_cache_memory_bytes=budget, enable_prefix_caching=prefix_caching)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": row} for row in rows]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    stats = engine.scheduler.stats()
    return seconds, [list(o.outputs[0].token_ids) for o in outputs], stats.prefix_cache_hit_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--templates", type=int, default=4)
    parser.add_argument("--duplicates", type=float, default=0.3)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--budget-prefixes", type=int, default=3, help="prefixes the KV budget holds at once")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    model_dir = build_hybrid_model()
    rows = templated_rows(args.rows, args.templates, args.duplicates)
    budget = cache_budget(model_dir, args.budget_prefixes * 400, args.max_num_seqs)
    prompt_tokens = sum(len(row) for row in rows)
    bound = prompt_tokens / distinct_tokens(rows)
    print(f"{len(rows)} rows, {prompt_tokens} prompt tokens, prefill-token bound {bound:.2f}x, "
          f"cache budget {budget} bytes")
    best = {True: float("inf"), False: float("inf")}
    tokens: dict[bool, list[list[int]]] = {}
    for round_index in range(args.repeat):
        for prefix_caching in (False, True):
            seconds, tokens[prefix_caching], hit_rate = run(
                model_dir, rows, args.output_len, budget, args.max_num_seqs, prefix_caching)
            best[prefix_caching] = min(best[prefix_caching], seconds)
            hits = f", hit rate {hit_rate:.2f}" if hit_rate is not None else ""
            print(f"round {round_index}: prefix caching {'on ' if prefix_caching else 'off'}: "
                  f"{len(rows) / seconds:.2f} rows/s{hits}")
    assert tokens[True] == tokens[False], "prefix caching changed the greedy tokens"
    ratio = best[False] / best[True]
    print(f"prefix caching on / off: {ratio:.2f}x rows/s (best of {args.repeat}); "
          f"{ratio / bound:.2f} of the prefill-token bound")


if __name__ == "__main__":
    main()
