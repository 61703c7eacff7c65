"""shardline vs Hugging Face transformers, side by side in one process.

Same random-weight Llama-shaped model (float32), same prompts (random tokens),
greedy, ignore_eos, fixed output length. Prints output tokens/s for transformers'
static batched generate (left padding), optionally its continuous batching
(generate_batch), and shardline, with the ratios, the fraction of this machine's
fp32 matmul peak shardline's arithmetic reaches, and its roofline share: the
tokens/s shardline achieves over the tokens/s the host's roofline allows (each step
at least its bytes over the measured memory bandwidth and its arithmetic over the
matmul peak; bench/roofline.py). Beside it, the bound of a run whose decode steps read
the KV cache after their linears' arithmetic instead of during it, as one thread
running the attention and the linears in turn does: how much of the roofline such a
run can reach at all, and how close shardline's run comes to that bound.

    python bench/bench_engine.py [--num-prompts 64] [--output-len 128] [--continuous]
                                 [--skip-hf] [--profile] [--dtype bfloat16] [--repeat 2]
    python bench/bench_engine.py --sweep [--cpu-time] [--repeat 1] [--shapes 0 3] [--skip-hf] [--profile]
                                 [--without PATH]
    python bench/bench_engine.py --skip-hf --without small_linear_kernel [--cpu-time]
    python bench/bench_engine.py --skip-hf --also-dtype bfloat16 [--cpu-time]

``--without PATH`` also runs, interleaved in the same process, an engine loaded with
that CPU path turned off (as ``SHARDLINE_CPU_PATHS=PATH=off`` would), and prints
shardline's ratio to it.

``--also-dtype DTYPE`` also runs, interleaved in the same process, an engine loaded in
that dtype (bfloat16 beside the default float32: the issue's bfloat16 goal is a
throughput ratio to shardline's own float32), and prints its ratio to shardline's.

``--sweep`` runs a grid of workload shapes (vocabularies 8k-128k, prompts 32-2048
tokens, 32-512 output tokens; SWEEP_SHAPES) against transformers' static generate
and prints, per shape, both sides' tokens/s, the ratio and the roofline share, and the
ratio a run at the roofline would reach (transformers' seconds over the roofline's: a
shape whose ceiling is below a goal cannot meet it on that host, whatever the engine
does short of cutting arithmetic the roofline counts), and the share a run whose
decode steps do not overlap their KV reads with their arithmetic reaches at best.

Each side runs ``--repeat`` times, interleaved round by round (transformers, then
shardline), and the best runs are compared: this machine's speed swings between
runs, and the best run of each side is its least disturbed one. Every run is printed.

``--dtype bfloat16`` runs both sides in bfloat16 (the roofline then uses bfloat16
matmul peaks and bytes); the issue's workload is float32.

The host's CPU and instruction-set levels (torch's kernels, the C kernels' build,
oneDNN) and the CPU paths the engine chose are printed with the results, so figures
from different hosts are not compared blindly. To run an AVX-512 host as an AVX2 one:
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
SHARDLINE_CPU_TARGET=x86-64-v3``.

``--cpu-time`` runs both sides on one thread and times each by that thread's CPU
time instead of the wall clock: on a machine other work is loading, the ratio then
stays that of the two sides' own work (the absolute figures are one core's; the
bandwidth and peaks are measured on that thread too).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import transformers
from common import StepProfile, build_bench_model, non_embedding_params, peak_matmul_flops, random_prompts, run_clock
from roofline import ModelShape, Roofline, memory_bandwidth, roofline

from shardline import LLM, SamplingParams
from shardline.engine.cpu.capability import host_cpu
from shardline.engine.llm_engine import LLMEngine

# What the runs are timed by: the wall clock, or with --cpu-time the thread's CPU time.
clock: Callable[[], float] = time.perf_counter


@dataclass(frozen=True)
class Workload:
    """One shape of the benchmark's workload: random prompts of ``min_len``-``max_len``
    tokens over a ``vocab_size`` vocabulary, ``output_len`` tokens generated after each."""

    vocab_size: int
    num_prompts: int
    min_len: int
    max_len: int
    output_len: int

    def describe(self) -> str:
        return (f"vocab {self.vocab_size // 1024}k, {self.num_prompts} prompts of {self.min_len}-{self.max_len}, "
                f"{self.output_len} out")


# The sweep's grid: each vocabulary at the default prompts, and the extremes of prompt
# and output lengths (long prompts, long outputs, long contexts at the largest vocabulary,
# many short requests). Sized so one round takes minutes on one thread.
SWEEP_SHAPES = (
    Workload(8192, 16, 32, 512, 128),
    Workload(32768, 16, 32, 512, 128),
    Workload(131072, 16, 32, 512, 128),
    Workload(8192, 32, 32, 64, 32),
    Workload(32768, 4, 1024, 2048, 32),
    Workload(32768, 16, 32, 128, 512),
    Workload(131072, 4, 1024, 2048, 128),
)


@dataclass(frozen=True)
class HostLimits:
    """The host's measured matmul peaks and memory bandwidths (best observed, bytes/s)."""

    peaks: dict[str, float]
    bandwidths: dict[str, float]

    @classmethod
    def measure(cls, dtype: torch.dtype) -> HostLimits:
        return cls(peak_matmul_flops(dtype, clock=clock), memory_bandwidth(clock))

    def best_with(self, other: HostLimits) -> HostLimits:
        """Each figure's best of two measurements (one taken in a slow phase alone
        would flatter the roofline)."""
        return HostLimits({name: max(value, other.peaks[name]) for name, value in self.peaks.items()},
                          {name: max(value, other.bandwidths[name]) for name, value in self.bandwidths.items()})

    @property
    def peak(self) -> tuple[str, float]:
        name = max(self.peaks, key=self.peaks.__getitem__)
        return name, self.peaks[name]

    @property
    def bandwidth(self) -> float:
        return max(self.bandwidths.values())

    def describe(self) -> str:
        return ("matmul peaks: " + ", ".join(f"{name} {value / 1e9:.1f} GFLOP/s" for name, value in self.peaks.items())
                + "; memory bandwidth: " + ", ".join(f"{name} {value / 1e9:.1f} GB/s"
                                                    for name, value in self.bandwidths.items()))


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


def run_rounds(runners: dict[str, Callable[[], float]], repeat: int, profile_last: bool,
               installed: StepProfile | None = None) -> tuple[dict[str, list[float]], StepProfile | None]:
    """Every side's seconds per round, interleaved (a slow phase of the machine hits
    every side), and with ``profile_last`` the last shardline run's profile (into
    ``installed``, its figures cleared first, where one is already installed: its
    wrappers stay on the engine's classes)."""
    results: dict[str, list[float]] = {name: [] for name in runners}
    profile = None
    for round_index in range(repeat):
        for name, run in runners.items():
            if name == "shardline" and profile_last and round_index == repeat - 1:
                # The last round's shardline run only.
                profile = installed or StepProfile(clock)
                profile.seconds.clear()
            with torch.inference_mode():
                results[name].append(run())
    return results, profile


def time_lm_head(llm: LLM, profile: StepProfile) -> StepProfile:
    """``profile`` also timing ``llm``'s LM head (the model's output linear) as "lm head":
    part of the forward's linears, at the rows each step samples."""
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine), "one process's engine (no tensor or data parallelism here)"
    model = engine.model
    assert isinstance(model, transformers.PreTrainedModel), "a transformers model"
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Module), "a causal LM has an output linear"
    forward = cast(Callable[[torch.Tensor], torch.Tensor], head.forward)

    def timed(x: torch.Tensor) -> torch.Tensor:
        start = clock()
        try:
            return forward(x)
        finally:
            profile.seconds["lm head"] = profile.seconds.get("lm head", 0.0) + clock() - start

    head.forward = timed
    return profile


def print_profile(profile: StepProfile, total: float) -> None:
    print("shardline profile (last run):\n" + profile.report(total))
    print(f"  {'of which the LM head':30s} {profile.seconds.get('lm head', 0.0):7.2f} s", flush=True)


def print_runs(results: dict[str, list[float]], output_tokens: int, over_ours: tuple[str, ...] = ()) -> None:
    """Every side's runs, and shardline's speedup over each other side (for the sides
    in ``over_ours``, that side's speedup over shardline instead)."""
    best = {name: min(runs) for name, runs in results.items()}
    for name, runs in results.items():
        print(f"{name:32s} {best[name]:8.2f} s  {output_tokens / best[name]:9.1f} output tok/s   "
              f"runs: {', '.join(f'{seconds:.2f}' for seconds in runs)} s")
    for name in best:
        if name == "shardline":
            continue
        slower, faster = (name, "shardline") if name not in over_ours else ("shardline", name)
        ratios = ", ".join(f"{theirs / mine:.2f}x" for theirs, mine in zip(results[slower], results[faster]))
        print(f"{faster} / {slower}: {best[slower] / best[faster]:.2f}x (best against best; round by round: {ratios})")


def workload_roofline(shape: ModelShape, max_num_seqs: int, prompts: list[list[int]], output_len: int,
                      limits: HostLimits) -> Roofline:
    return roofline(shape, [len(p) for p in prompts], output_len, max_num_seqs, limits.bandwidth, limits.peak[1])


def default_run(args: argparse.Namespace) -> None:
    model_dir = build_bench_model()
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, 16384)
    output_tokens = args.num_prompts * args.output_len
    prompt_tokens = sum(len(p) for p in prompts)

    dtype = getattr(torch, args.dtype)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    llm = LLM(model_dir, dtype=args.dtype)
    llm.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(max_tokens=2), use_tqdm=False)

    runners: dict[str, Callable[[], float]] = {}
    if not args.skip_hf:
        runners["transformers static generate"] = lambda: run_hf_static(hf_model, prompts, args.output_len,
                                                                        args.hf_batch_size)
        if args.continuous:
            runners["transformers generate_batch"] = lambda: run_hf_continuous(hf_model, prompts, args.output_len)
    runners["shardline"] = lambda: run_shardline(llm, prompts, args.output_len)
    for path in args.without:
        other = engine_without(model_dir, args.dtype, path)
        other.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(max_tokens=2), use_tqdm=False)
        runners[f"shardline without {path}"] = lambda other=other: run_shardline(other, prompts, args.output_len)
    for other_dtype in args.also_dtype:
        other = LLM(model_dir, dtype=other_dtype)
        other.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(max_tokens=2), use_tqdm=False)
        runners[f"shardline {other_dtype}"] = lambda other=other: run_shardline(other, prompts, args.output_len)
    limits_before = HostLimits.measure(dtype)
    installed = time_lm_head(llm, StepProfile(clock)) if args.profile else None
    results, profile = run_rounds(runners, args.repeat, args.profile, installed)

    print(f"host: {host_cpu().describe()}")
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine), "one process's engine (no tensor or data parallelism here)"
    print(f"shardline CPU paths: {engine.cpu_paths.describe()}")
    print(f"workload: {args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens "
          f"({prompt_tokens} prompt tokens), {args.output_len} output tokens each, greedy, {args.dtype}, "
          f"{torch.get_num_threads()} threads, {args.repeat} interleaved round(s), best of each compared")
    print_runs(results, output_tokens, over_ours=tuple(f"shardline {other}" for other in args.also_dtype))
    ours = min(results["shardline"])
    flops = 2 * non_embedding_params(hf_model) * (prompt_tokens + output_tokens)
    limits = limits_before.best_with(HostLimits.measure(dtype))
    peak_name, peak = limits.peak
    print(limits.describe())
    print(f"roofline (best shardline run): {flops / ours / 1e9:.1f} GFLOP/s achieved of {peak / 1e9:.1f} GFLOP/s "
          f"peak {peak_name} ({100 * flops / ours / peak:.1f}%)")
    bound = workload_roofline(ModelShape.of(hf_model.config, dtype), llm.engine_config.max_num_seqs, prompts,
                              args.output_len, limits)
    print(f"roofline share (best shardline run): {output_tokens / ours:.1f} output tok/s achieved of "
          f"{output_tokens / bound.seconds:.1f} the roofline allows ({100 * bound.seconds / ours:.1f}%; "
          f"bound {bound.seconds:.2f} s: {bound.describe()})")
    print(f"one thread in turn (each decode step's KV reads after its linears, not overlapped): bound "
          f"{bound.in_turn_s:.2f} s, {100 * bound.seconds / bound.in_turn_s:.1f}% of the roofline at best, "
          f"the run at {100 * bound.in_turn_s / ours:.1f}% of this bound")
    if profile is not None:
        print_profile(profile, results["shardline"][-1])


def engine_without(model_dir: str, dtype: str, path: str) -> LLM:
    """An engine loaded with the CPU path ``path`` turned off (SHARDLINE_CPU_PATHS, read at load)."""
    before = os.environ.get("SHARDLINE_CPU_PATHS")
    os.environ["SHARDLINE_CPU_PATHS"] = ",".join(filter(None, (before, f"{path}=off")))
    try:
        return LLM(model_dir, dtype=dtype)
    finally:
        if before is None:
            del os.environ["SHARDLINE_CPU_PATHS"]
        else:
            os.environ["SHARDLINE_CPU_PATHS"] = before


def sweep(args: argparse.Namespace) -> None:
    """Every shape of SWEEP_SHAPES, one model per vocabulary; a table at the end."""
    dtype = getattr(torch, args.dtype)
    limits = HostLimits.measure(dtype)
    rows = []
    profile: StepProfile | None = None
    shapes = [SWEEP_SHAPES[index] for index in args.shapes] if args.shapes else list(SWEEP_SHAPES)
    for vocab_size in dict.fromkeys(shape.vocab_size for shape in shapes):
        with tempfile.TemporaryDirectory(prefix="shardline-bench-") as model_dir:
            build_bench_model(Path(model_dir), vocab_size=vocab_size, max_position_embeddings=4096)
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
            llm = LLM(model_dir, dtype=args.dtype)
            others = {path: engine_without(model_dir, args.dtype, path) for path in args.without}
            for engine in (llm, *others.values()):
                engine.generate({"prompt_token_ids": [5] * 16}, SamplingParams(max_tokens=2), use_tqdm=False)
            if args.profile:  # once per engine: its wrappers stay for the later shapes (a second would nest)
                profile = time_lm_head(llm, profile or StepProfile(clock))
            for shape in (s for s in shapes if s.vocab_size == vocab_size):
                rows.append(sweep_shape(shape, hf_model, llm, args, profile, others))
            for engine in (llm, *others.values()):
                engine.close()
            del llm, hf_model, others
            gc.collect()
    limits = limits.best_with(HostLimits.measure(dtype))
    print(f"host: {host_cpu().describe()}")
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {args.repeat} interleaved round(s), best of each; "
          + limits.describe())
    print(f"{'shape':52s} {'transformers':>12s} {'shardline':>10s} {'ratio':>6s} {'roofline':>9s} {'share':>6s} "
          f"{'ceiling':>7s} {'in turn':>7s}")
    for shape, hf_seconds, ours, bound in rows:
        tokens = shape.num_prompts * shape.output_len
        host_bound = bound(limits)
        bound_seconds = host_bound.seconds
        theirs = ((f"{tokens / hf_seconds:12.1f}", f"{hf_seconds / ours:5.2f}x", f"{hf_seconds / bound_seconds:6.2f}x")
                  if hf_seconds else (f"{'-':>12s}", f"{'-':>6s}", f"{'-':>7s}"))
        print(f"{shape.describe():52s} {theirs[0]} {tokens / ours:10.1f} {theirs[1]} "
              f"{tokens / bound_seconds:9.1f} {100 * bound_seconds / ours:5.1f}% {theirs[2]} "
              f"{100 * bound_seconds / host_bound.in_turn_s:6.1f}%")
    print("(output tok/s; roofline: the tok/s the host's roofline allows; share: achieved over allowed; "
          "ceiling: the ratio a run at the roofline would reach; in turn: the share a run reaches at best "
          "whose decode steps read the KV cache after their linears' arithmetic, not overlapping the two)")


def sweep_shape(shape: Workload, hf_model, llm: LLM, args: argparse.Namespace, installed: StepProfile | None,
                others: dict[str, LLM]):
    """One shape's best transformers (None with --skip-hf) and shardline seconds and its
    roofline (of the host limits, measured again at the end); with --profile, the
    shardline run's split printed (into ``installed``, the sweep's one profile).
    ``others``: engines loaded with a CPU path off (--without), run interleaved and
    compared in the shape's printout."""
    prompts = random_prompts(shape.num_prompts, shape.min_len, shape.max_len, shape.vocab_size)
    runners: dict[str, Callable[[], float]] = {}
    if not args.skip_hf:
        runners["transformers static generate"] = lambda: run_hf_static(hf_model, prompts, shape.output_len,
                                                                        args.hf_batch_size)
    runners["shardline"] = lambda: run_shardline(llm, prompts, shape.output_len)
    for path, other in others.items():
        runners[f"shardline without {path}"] = lambda other=other: run_shardline(other, prompts, shape.output_len)
    results, profile = run_rounds(runners, args.repeat, args.profile, installed)
    print(f"{shape.describe()}:", flush=True)
    print_runs(results, shape.num_prompts * shape.output_len)
    if profile is not None:
        print_profile(profile, results["shardline"][-1])
    model_shape = ModelShape.of(hf_model.config, getattr(torch, args.dtype))
    max_num_seqs = llm.engine_config.max_num_seqs
    hf_seconds = min(results["transformers static generate"]) if not args.skip_hf else None
    return (shape, hf_seconds, min(results["shardline"]),
            lambda host: workload_roofline(model_shape, max_num_seqs, prompts, shape.output_len, host))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
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
    parser.add_argument("--without", action="append", default=[], metavar="PATH",
                        help="also run an engine with this CPU path turned off (repeatable; default workload)")
    parser.add_argument("--also-dtype", action="append", default=[], choices=["float32", "bfloat16"],
                        metavar="DTYPE", help="also run an engine in this dtype and print its throughput ratio to "
                                              "shardline's (repeatable; default workload)")
    parser.add_argument("--shapes", type=int, nargs="+", default=[], metavar="INDEX",
                        help="with --sweep, only these shapes of SWEEP_SHAPES (0-based)")
    parser.add_argument("--sweep", action="store_true",
                        help="run the grid of workload shapes (SWEEP_SHAPES) against transformers' static generate")
    args = parser.parse_args()
    global clock
    clock = run_clock(args.cpu_time)
    if args.sweep:
        sweep(args)
    else:
        default_run(args)


if __name__ == "__main__":
    main()
