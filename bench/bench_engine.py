"""shardline vs Hugging Face transformers, side by side in one process.

Same random-weight Llama-shaped model (float32), same prompts (random tokens),
greedy, ignore_eos, fixed output length. Prints output tokens/s for transformers'
static batched generate (left padding), optionally its continuous batching
(generate_batch), and shardline, with the ratios and the fraction of this
machine's fp32 matmul roofline that shardline reaches.

    python bench/bench_engine.py [--num-prompts 64] [--output-len 128] [--continuous]
                                 [--skip-hf] [--profile] [--dtype bfloat16] [--repeat 2]

Each side runs ``--repeat`` times, interleaved round by round (transformers, then
shardline), and the best runs are compared: this machine's speed swings between
runs, and the best run of each side is its least disturbed one. Every run is printed.

``--dtype bfloat16`` runs both sides in bfloat16 (the roofline then uses bfloat16
matmul peaks); the issue's workload is float32.

The host's CPU and instruction-set levels (torch's kernels, the C kernels' build,
oneDNN) and the CPU paths the engine chose are printed with the results, so figures
from different hosts are not compared blindly. To run an AVX-512 host as an AVX2 one:
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
SHARDLINE_CPU_TARGET=x86-64-v3``.

``--cpu-time`` runs both sides on one thread and times each by that thread's CPU
time instead of the wall clock: on a machine other work is loading, the ratio then
stays that of the two sides' own work (the absolute figures are one core's).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import transformers
from common import StepProfile, build_bench_model, non_embedding_params, peak_matmul_flops, random_prompts, run_clock

from shardline import LLM, SamplingParams
from shardline.engine.cpu.capability import host_cpu

# What the runs are timed by: the wall clock, or with --cpu-time the thread's CPU time.
clock: Callable[[], float] = time.perf_counter


def run_hf_static(model, prompts: list[list[int]], output_len: int, batch_size: int) -> float:
    """Seconds for transformers' generate over left-padded batches."""
    start = clock()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[2] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                       do_sample=False, pad_token_id=2)
    return clock() - start


def run_hf_continuous(model, prompts: list[list[int]], output_len: int) -> float:
    config = transformers.GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1,
                                           pad_token_id=2)
    start = clock()
    model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    return clock() - start


def run_shardline(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.reset_prefix_cache()  # a repeated run computes every prompt again, as transformers does
    start = clock()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = clock() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--continuous", action="store_true", help="also run transformers' generate_batch")
    parser.add_argument("--skip-hf", action="store_true", help="run shardline only (no ratios)")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds of every side; best against best")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="model dtype on both sides")
    parser.add_argument("--profile", action="store_true",
                        help="time shardline's parts: scheduling, batch preparation, forward, attention, "
                             "sampling, output processing (by the run's clock)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by its CPU time (for a machine other work is loading)")
    args = parser.parse_args()
    global clock
    clock = run_clock(args.cpu_time)

    model_dir = build_bench_model()
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, 16384)
    output_tokens = args.num_prompts * args.output_len
    prompt_tokens = sum(len(p) for p in prompts)

    dtype = getattr(torch, args.dtype)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    llm = LLM(model_dir, dtype=args.dtype)
    llm.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(max_tokens=2), use_tqdm=False)

    runners = {}
    if not args.skip_hf:
        runners["transformers static generate"] = lambda: run_hf_static(hf_model, prompts, args.output_len,
                                                                        args.hf_batch_size)
        if args.continuous:
            runners["transformers generate_batch"] = lambda: run_hf_continuous(hf_model, prompts, args.output_len)
    runners["shardline"] = lambda: run_shardline(llm, prompts, args.output_len)
    results: dict[str, list[float]] = {name: [] for name in runners}
    peaks_before = peak_matmul_flops(dtype, clock=clock)
    profile = None
    for round_index in range(args.repeat):  # interleaved, so a slow phase of the machine hits every side
        for name, run in runners.items():
            if name == "shardline" and args.profile and round_index == args.repeat - 1:
                profile = StepProfile(clock)  # the last round's shardline run only
            with torch.inference_mode():
                results[name].append(run())

    print(f"host: {host_cpu().describe()}")
    print(f"shardline CPU paths: {llm.llm_engine.cpu_paths.describe()}")
    print(f"workload: {args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens "
          f"({prompt_tokens} prompt tokens), {args.output_len} output tokens each, greedy, {args.dtype}, "
          f"{torch.get_num_threads()} threads, {args.repeat} interleaved round(s), best of each compared")
    best = {name: min(runs) for name, runs in results.items()}
    for name, runs in results.items():
        print(f"{name:32s} {best[name]:8.2f} s  {output_tokens / best[name]:9.1f} output tok/s   "
              f"runs: {', '.join(f'{seconds:.2f}' for seconds in runs)} s")
    ours = best["shardline"]
    for name, seconds in best.items():
        if name != "shardline":
            ratios = ", ".join(f"{theirs / mine:.2f}x" for theirs, mine in zip(results[name], results["shardline"]))
            print(f"shardline / {name}: {seconds / ours:.2f}x (best against best; round by round: {ratios})")
    flops = 2 * non_embedding_params(hf_model) * (prompt_tokens + output_tokens)
    # The machine's peak: the best of a measurement before the runs and one after (one
    # taken in a slow phase alone would flatter the roofline).
    peaks = {name: max(before, after) for (name, before), after in
             zip(peaks_before.items(), peak_matmul_flops(dtype, clock=clock).values())}
    peak_name = max(peaks, key=peaks.get)
    peak = peaks[peak_name]
    print("matmul peaks: " + ", ".join(f"{name} {value / 1e9:.1f} GFLOP/s" for name, value in peaks.items()))
    print(f"roofline (best shardline run): {flops / ours / 1e9:.1f} GFLOP/s achieved of {peak / 1e9:.1f} GFLOP/s "
          f"peak {peak_name} ({100 * flops / ours / peak:.1f}%)")
    if profile is not None:
        print("shardline profile (last run):\n" + profile.report(results["shardline"][-1]))


if __name__ == "__main__":
    main()
