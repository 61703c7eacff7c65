"""Tensor parallelism's per-step cost on CPU: the same workload on one rank and on two
gloo ranks, side by side in one process, with their ratio.

On a CPU host tensor parallelism is a correctness feature (the CUDA path is the one
that pays): two ranks share the host's cores, each step adds one broadcast of its inputs
and two all-reduces per layer, and the ranks take no CPU fast path. The figures show
what a step costs for it. Runs, each engine from a cold cache:
- tp1: one rank, with the CPU fast paths this host takes;
- tp1-plain: one rank without them (SHARDLINE_CPU_PATHS=all=off), the same kernels
  the ranks run;
- tp2: two ranks.
Every run must give the same greedy tokens; the bench says if one does not.

    python bench/bench_tp.py [--prompts 16] [--max-tokens 32] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import time

from common import build_bench_model, random_prompts

from shardline import LLM, SamplingParams


def run(model_dir: str, size: int, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list]:
    """(seconds generating, steps run, tokens) of one engine over the workload."""
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=size, max_num_seqs=len(prompts))
    try:
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, llm.llm_engine.stats().num_steps, [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    model_dir = build_bench_model(num_hidden_layers=args.layers)
    prompts = random_prompts(args.prompts, 32, 96, 16384, seed=0)
    results = {}
    for name, size, paths in (("tp1", 1, None), ("tp1-plain", 1, "all=off"), ("tp2", 2, None)):
        if paths is None:
            os.environ.pop("SHARDLINE_CPU_PATHS", None)
        else:
            os.environ["SHARDLINE_CPU_PATHS"] = paths
        results[name] = run(model_dir, size, prompts, args.max_tokens)
    os.environ.pop("SHARDLINE_CPU_PATHS", None)
    base_tokens = results["tp1"][2]
    print(f"{args.prompts} prompts of 32-96 tokens, {args.max_tokens} new tokens each, Llama-shaped "
          f"{args.layers} layers x 512 wide, float32, {os.cpu_count()} CPUs")
    for name, (elapsed, steps, tokens) in results.items():
        same = "same tokens" if tokens == base_tokens else "TOKENS DIFFER from tp1"
        print(f"{name:10s} {elapsed:7.2f} s  {steps:4d} steps  {1000 * elapsed / steps:8.1f} ms/step  {same}")
    per_step = {name: elapsed / steps for name, (elapsed, steps, _) in results.items()}
    print(f"tp2 / tp1 per step: {per_step['tp2'] / per_step['tp1']:.2f}x; "
          f"tp2 / tp1-plain: {per_step['tp2'] / per_step['tp1-plain']:.2f}x")


if __name__ == "__main__":
    main()
