"""A hybrid model (gated delta-net beside full attention) in shardline vs transformers,
side by side in one process.

A random-weight Qwen3.5-shaped text model at the Llama benchmark's width (hidden 512,
8 layers, float32), with qwen3_5_text's layer pattern: three gated delta-net layers
to one full-attention layer. Same prompts (random tokens), greedy, ignore_eos, fixed
output length. Prints output tokens/s for transformers' static batched generate (left
padding) and shardline, and their ratio; ``--llama`` runs bench_engine.py's
Llama-shaped model through the same harness in the same process, so the two ratios
are measured under the same load.

    python bench/bench_hybrid.py [--num-prompts 32] [--output-len 64] [--repeat 2] [--llama] [--cpu-time]

Each side runs ``--repeat`` times, interleaved round by round; best against best,
every run printed (this machine's speed swings between runs). ``--cpu-time`` runs
both sides on one thread, timed by that thread's CPU time, as bench_engine.py's
``--cpu-time`` does: on a machine other work is loading, the ratios then stay those
of the two sides' own work (the absolute figures are one core's).
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import bench_engine
import torch
import transformers
from bench_engine import run_hf_static, run_shardline
from common import LLAMA_BENCH_CONFIG, build_bench_model, random_prompts, scratch_dir

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tokenizer

# qwen3_5_text's pattern (full attention every fourth layer) at the Llama benchmark's width.
HYBRID_BENCH_CONFIG = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    intermediate_size=1536, vocab_size=16384, max_position_embeddings=2048,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
    bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
)


def build_hybrid_model(path: Path | None = None) -> str:
    """Write the hybrid benchmark model (random weights) and a tokenizer; return its directory."""
    path = Path(path or scratch_dir("shardline-bench-hybrid-"))
    build_tokenizer(path)
    config = dict(HYBRID_BENCH_CONFIG)
    config["layer_types"] = config["layer_types"] * (config["num_hidden_layers"] // 4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig(**config))
    model.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(str(path))
    return str(path)


def replacement_modules(model: torch.nn.Module) -> str:
    """How many of each of the CPU path's replacement modules the engine's model holds."""
    counts = collections.Counter(type(module).__name__ for module in model.modules())
    return ", ".join(f"{name} {count}" for name, count in sorted(counts.items())
                     if name.startswith(("Fused", "Packed", "Sampled")) or name.endswith("Projections")
                     or name == "RecurrentLayer")


def side_by_side(name: str, model_dir: str, prompts: list[list[int]], args) -> float:
    """Interleaved runs of both sides on one model; prints them and returns the ratio."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, dtype="float32")
    llm.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(max_tokens=2), use_tqdm=False)
    runners = {"transformers static generate": lambda: run_hf_static(hf_model, prompts, args.output_len,
                                                                     args.hf_batch_size),
               "shardline": lambda: run_shardline(llm, prompts, args.output_len)}
    results: dict[str, list[float]] = {side: [] for side in runners}
    for _ in range(args.repeat):
        for side, run in runners.items():
            with torch.inference_mode():
                results[side].append(run())
    output_tokens = len(prompts) * args.output_len
    print(f"== {name}")
    print(f"shardline CPU paths: {llm.llm_engine.cpu_paths.describe()}; {llm.llm_engine.cpu_rewrites}")
    print(f"shardline replacement modules: {replacement_modules(llm.llm_engine.model)}")
    for side, runs in results.items():
        best = min(runs)
        print(f"{side:32s} {best:8.2f} s  {output_tokens / best:9.1f} output tok/s   "
              f"runs: {', '.join(f'{seconds:.2f}' for seconds in runs)} s")
    ratio = min(results["transformers static generate"]) / min(results["shardline"])
    rounds = ", ".join(f"{theirs / mine:.2f}x" for theirs, mine in
                       zip(results["transformers static generate"], results["shardline"]))
    print(f"shardline / transformers static generate: {ratio:.2f}x (best against best; round by round: {rounds})")
    llm.close()
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--llama", action="store_true", help="also the Llama-shaped model, for its ratio")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by its CPU time (for a machine other work is loading)")
    args = parser.parse_args()
    if args.cpu_time:  # bench_engine's runners read their clock from that module
        torch.set_num_threads(1)
        bench_engine.clock = time.thread_time

    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, LLAMA_BENCH_CONFIG["vocab_size"])
    print(f"workload: {args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens "
          f"({sum(len(p) for p in prompts)} prompt tokens), {args.output_len} output tokens each, greedy, "
          f"float32, {torch.get_num_threads()} threads, timed by {'CPU' if args.cpu_time else 'wall'} time, "
          f"{args.repeat} interleaved round(s), best of each compared")
    hybrid = side_by_side("hybrid (3 gated delta-net : 1 full attention, hidden 512, 8 layers)",
                          build_hybrid_model(), prompts, args)
    if args.llama:
        llama = side_by_side("Llama-shaped (hidden 512, 8 layers)", build_bench_model(), prompts, args)
        print(f"hybrid ratio / Llama ratio: {hybrid / llama:.2f}")


if __name__ == "__main__":
    main()
