"""Tensor parallelism's per-step cost on CPU: the same workload on one rank and on two
gloo ranks, side by side in one process, with their ratio.

On a CPU host tensor parallelism is a correctness feature (the CUDA path is the one
that pays): two ranks share the host's cores, each step adds one broadcast of its inputs
and two all-reduces per layer, and the ranks take only the CPU fast paths a split model
runs (engine/parallel/ranks.py: no fused decoder layers or MLPs). The figures show
what a step costs for it. Runs, each engine from a cold cache:
- tp1: one rank, with the CPU fast paths this host takes;
- tp1-plain: one rank without them (SHARDLINE_CPU_PATHS=all=off);
- tp1-plain-half: the same on half the threads, as each of the two ranks gets;
- tp2: two ranks.
On a host other work keeps busy, runs on several threads lose most (each parallel
region waits for its slowest thread), so compare tp2 with tp1-plain-half as well.
Every run must give the same greedy tokens; the bench says if one does not.

``--memory``: host memory instead of time. Each rank's peak resident memory (VmHWM)
while it loads its shard of a model of a few hundred MB, each load in a fresh process:
the rank reading the whole checkpoint before splitting it, and reading only its slices
(engine/parallel/loading.py); then a two-rank engine's processes after loading. With
``--quantized``, the checkpoint's linears are FP8 with a scale per output channel, and a
rank reads the checkpoint whole before the split or as its slices (quantized linears and
experts: engine/parallel/quantized_slices.py; the float embedding, LM head and norms:
engine/parallel/loading.py). ``--moe``: a Qwen3-MoE-shaped model (8 experts per layer,
stored per expert) instead of the Llama-shaped one. The goal: a rank's load adds about
its share of the stored bytes (each in the dtype it runs in) plus the parts every rank
keeps whole (norms, routers); the line "expected" says how much that is.

    python bench/bench_tp.py [--prompts 16] [--max-tokens 32] [--layers 4] [--rounds 2]
    python bench/bench_tp.py --memory [--layers 6] [--hidden 1024] [--quantized] [--moe]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import transformers
from common import build_bench_model, random_prompts, scratch_dir
from safetensors.torch import load_file, save_file

from shardline import LLM, SamplingParams
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.tiny import build_tokenizer
from shardline.engine.parallel.ranks import RankDriver


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


def peak_rss_mib(pid: int | str | None = "self") -> float:
    """A process's peak resident memory (VmHWM), MiB."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def load_one_rank(model_dir: str, how: str, rank: int) -> None:
    """In this (fresh) process: rank ``rank`` of 2's load of its shard as the engine makes
    it (``how``: "whole" reads the checkpoint whole, "slices" only its parts; "none"
    only imports), then print the peak resident memory."""
    from shardline.engine.config import EngineConfig
    from shardline.engine.model.adapters import adapt_attention
    from shardline.engine.model.kv_cache_spec import KVCacheSpec
    from shardline.engine.model.loader import load_causal_lm
    from shardline.engine.parallel.group import RankGroup
    from shardline.engine.parallel.loading import SliceReader
    from shardline.engine.parallel.placement import shard_then_place

    if how != "none" and os.path.exists(os.path.join(model_dir, QUANTIZED_MARK)):
        return load_one_quantized_rank(model_dir, how, rank)
    if how != "none":
        reader = SliceReader() if how == "slices" else None
        loaded = load_causal_lm(EngineConfig(model=model_dir, dtype="float32", tensor_parallel_size=2), reader)
        assert (reader is None) == (how == "whole") and (reader is None or reader.checkpoint is not None)
        adapt_attention(loaded.model)
        layers = sum(1 for layer in KVCacheSpec.from_hf_config(loaded.hf_config, loaded.dtype).layers
                     if layer.num_kv_heads)
        shard_then_place(loaded.model, RankGroup(rank, 2, lambda: ""), layers, torch.device("cpu"),
                         checkpoint=reader.checkpoint if reader is not None else None)
    print(f"{peak_rss_mib():.0f}")


QUANTIZED_MARK = "bench-fp8"  # a file beside the checkpoint: its linears are FP8


def load_one_quantized_rank(model_dir: str, how: str, rank: int) -> None:
    """``load_one_rank`` of an FP8 checkpoint: its linears read whole then split, or as
    this rank's slices."""
    from shardline.engine.config import EngineConfig
    from shardline.engine.model.kv_cache_spec import KVCacheSpec
    from shardline.engine.model.loader import load_causal_lm
    from shardline.engine.parallel.group import RankGroup
    from shardline.engine.parallel.loading import SliceReader
    from shardline.engine.parallel.placement import shard_then_place
    from shardline.engine.quantization.load import put_quantized_linears

    reader = SliceReader() if how == "slices" else None
    loaded = load_causal_lm(EngineConfig(model=model_dir, dtype="float32", tensor_parallel_size=2), reader)
    assert loaded.quantized is not None and (reader is None or reader.checkpoint is not None)
    layers = sum(1 for layer in KVCacheSpec.from_hf_config(loaded.hf_config, loaded.dtype).layers if layer.num_kv_heads)
    group = RankGroup(rank, 2, lambda: "")
    if how == "whole":
        put_quantized_linears(loaded.model, loaded.quantized)
    shard_then_place(loaded.model, group, layers, torch.device("cpu"),
                     checkpoint=reader.checkpoint if reader is not None else None,
                     quantized=loaded.quantized if how == "slices" else None)
    print(f"{peak_rss_mib():.0f}")


def write_fp8(model_dir: str) -> None:
    """Rewrite the checkpoint with its decoder linears FP8, one scale per output channel."""
    path = os.path.join(model_dir, "model.safetensors")
    tensors = {}
    for name, tensor in load_file(path).items():
        if name.endswith("_proj.weight"):
            scale = tensor.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 448.0
            tensors[name] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            tensors[name.removesuffix("weight") + "weight_scale"] = scale
        else:
            tensors[name] = tensor
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path) as file:
        config = json.load(file)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with open(config_path, "w") as file:
        json.dump(config, file)
    open(os.path.join(model_dir, QUANTIZED_MARK), "w").close()


def engine_memory(model_dir: str) -> None:
    """In this (fresh) process: a two-rank engine's peak resident memory per rank process."""
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=2, max_num_seqs=4, kv_cache_memory_bytes=16 << 20)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    followers = engine.runner.followers
    assert isinstance(followers, RankDriver)
    print(" ".join(f"{value:.0f}" for value in [peak_rss_mib(), *(peak_rss_mib(p.pid) for p in followers.processes)]))
    llm.close()


def build_moe_model(layers: int, hidden: int) -> str:
    """A Qwen3-MoE-shaped model (8 experts of intermediate size ``hidden``, 2 per token)
    with random weights, saved as transformers saves it (experts per expert)."""
    path = scratch_dir("shardline-bench-moe-")
    build_tokenizer(path)
    config = transformers.Qwen3MoeConfig(
        vocab_size=16384, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=hidden, intermediate_size=3 * hidden, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def whole_on_every_rank(model_dir: str, quantized: bool) -> float:
    """MiB of the checkpoint's tensors every rank keeps whole (norms, routers, per-channel
    scales: none the rules split), as they run (float32)."""
    whole = 0
    for name, tensor in load_file(os.path.join(model_dir, "model.safetensors")).items():
        split = name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight"))
        if not split or (quantized and name.endswith("weight_scale")):
            whole += tensor.numel() * 4
    return whole / 2**20


def memory(args: argparse.Namespace) -> None:
    if args.moe:
        model_dir = build_moe_model(args.layers, args.hidden)
    else:
        model_dir = build_bench_model(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                      intermediate_size=3 * args.hidden)
    # Stored in bfloat16, as published checkpoints are; the CPU engine runs float32.
    path = os.path.join(model_dir, "model.safetensors")
    save_file({name: tensor.to(torch.bfloat16) for name, tensor in load_file(path).items()}, path,
              metadata={"format": "pt"})
    if args.quantized:
        write_fp8(model_dir)
    size_mib = sum(os.path.getsize(os.path.join(model_dir, name)) for name in os.listdir(model_dir)
                   if name.endswith(".safetensors")) / 2**20

    def child(*argv: str) -> str:
        return subprocess.run([sys.executable, __file__, *argv], check=True, capture_output=True,
                              text=True).stdout.split("\n")[-2]

    imports = float(child("--load-rank", model_dir, "none", "0"))
    stored = "FP8 linears, bfloat16 rest" if args.quantized else "bfloat16"
    kept = whole_on_every_rank(model_dir, args.quantized)
    # As run: FP8 codes 1 byte each, everything else float32 (twice its bfloat16 bytes).
    running = sum(tensor.numel() * (1 if tensor.dtype == torch.float8_e4m3fn else 4)
                  for tensor in load_file(os.path.join(model_dir, "model.safetensors")).values()) / 2**20
    shape = "Qwen3-MoE-shaped (8 experts)" if args.moe else "Llama-shaped"
    print(f"{shape} {args.layers} layers x {args.hidden} wide, {stored} checkpoint {size_mib:.0f} MiB "
          f"({running:.0f} MiB as run in float32); peak resident memory of one rank's load (a process importing "
          f"the engine alone: {imports:.0f} MiB); expected per rank: a share {(running - kept) / 2:.0f} MiB + "
          f"whole on every rank {kept:.0f} MiB = +{(running - kept) / 2 + kept:.0f} MiB")
    for how in ("whole", "slices"):
        peaks = [float(child("--load-rank", model_dir, how, str(rank))) for rank in (0, 1)]
        print(f"rank reads {how:6s}: " + ", ".join(f"rank {rank} {peak:.0f} MiB (+{peak - imports:.0f})"
                                                   for rank, peak in enumerate(peaks)))
    peaks = child("--engine-memory", model_dir).split()
    print("two-rank engine after loading: " + ", ".join(f"rank {rank} {peak} MiB" for rank, peak in enumerate(peaks)))


def main() -> None:
    if sys.argv[1:2] == ["--load-rank"]:
        return load_one_rank(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    if sys.argv[1:2] == ["--engine-memory"]:
        return engine_memory(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, interleaved; the best is kept")
    parser.add_argument("--memory", action="store_true", help="peak host memory per rank while loading")
    parser.add_argument("--hidden", type=int, default=1024, help="--memory's model width")
    parser.add_argument("--quantized", action="store_true", help="--memory on an FP8 (per-channel) checkpoint")
    parser.add_argument("--moe", action="store_true", help="--memory on a Qwen3-MoE-shaped model")
    args = parser.parse_args()
    if args.memory:
        return memory(args)
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
