"""Tensor parallelism's per-step cost on CPU: the same workload on one rank and on two
gloo ranks, side by side in one process, with their ratio.

On a CPU host tensor parallelism is a correctness feature (the CUDA path is the one
that pays): two ranks share the host's cores, each step adds one broadcast of its inputs
and two all-reduces per layer, and the ranks take no CPU fast path. The figures show
what a step costs for it. Runs, each engine from a cold cache:
- tp1: one rank, with the CPU fast paths this host takes;
- tp1-plain: one rank without them (SHARDLINE_CPU_PATHS=all=off), the same kernels
  the ranks run;
- tp1-plain-half: the same on half the threads, as each of the two ranks gets;
- tp2: two ranks.
On a host other work keeps busy, runs on several threads lose most (each parallel
region waits for its slowest thread), so compare tp2 with tp1-plain-half as well.
Every run must give the same greedy tokens; the bench says if one does not.

    python bench/bench_tp.py [--prompts 16] [--max-tokens 32] [--layers 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from common import build_bench_model, random_prompts

from shardline import LLM, SamplingParams


def run(model_dir: str, size: int, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list]:
    """(seconds generating, steps run, tokens) of one engine over the workload."""
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=size, max_num_seqs=len(prompts))
    try:
        # First calls pay one-time costs (kernel builds, primitive caches): not timed.
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
        llm.reset_prefix_cache()
        steps_before = llm.llm_engine.stats().num_steps
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, llm.llm_engine.stats().num_steps - steps_before, [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, interleaved; the best is kept")
    args = parser.parse_args()
    model_dir = build_bench_model(num_hidden_layers=args.layers)
    prompts = random_prompts(args.prompts, 32, 96, 16384, seed=0)
    threads = torch.get_num_threads()  # a two-rank engine gives its process a share: each run starts equal
    results: dict[str, tuple[float, int, list]] = {}
    for _ in range(args.rounds):
        runs = (("tp2", 2, None, threads), ("tp1", 1, None, threads), ("tp1-plain", 1, "all=off", threads),
                ("tp1-plain-half", 1, "all=off", max(1, threads // 2)))
        for name, size, paths, run_threads in runs:
            torch.set_num_threads(run_threads)
            if paths is None:
                os.environ.pop("SHARDLINE_CPU_PATHS", None)
            else:
                os.environ["SHARDLINE_CPU_PATHS"] = paths
            result = run(model_dir, size, prompts, args.max_tokens)
            if name not in results or result[0] < results[name][0]:
                results[name] = result
    os.environ.pop("SHARDLINE_CPU_PATHS", None)
    base_tokens = results["tp1"][2]
    print(f"{args.prompts} prompts of 32-96 tokens, {args.max_tokens} new tokens each, Llama-shaped "
          f"{args.layers} layers x 512 wide, float32, {threads} torch threads; best of {args.rounds}")
    for name, (elapsed, steps, tokens) in results.items():
        same = "same tokens" if tokens == base_tokens else "TOKENS DIFFER from tp1"
        print(f"{name:15s} {elapsed:7.2f} s  {steps:4d} steps  {1000 * elapsed / steps:8.1f} ms/step  {same}")
    per_step = {name: elapsed / steps for name, (elapsed, steps, _) in results.items()}
    print(f"tp2 / tp1 per step: {per_step['tp2'] / per_step['tp1']:.2f}x; "
          f"tp2 / tp1-plain: {per_step['tp2'] / per_step['tp1-plain']:.2f}x; "
          f"tp2 / tp1-plain-half: {per_step['tp2'] / per_step['tp1-plain-half']:.2f}x")


if __name__ == "__main__":
    main()
