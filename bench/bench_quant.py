"""Quantized weights against bfloat16 on CPU, side by side in one process.

Two modes:

``--mode kernel``: one linear of the model's shapes (o_proj, gate and up packed
together, down_proj) in as many copies as the model has layers, each call on the
next copy (so the weights come from memory, as a decode step reads them), x of
M = 1, 8, 16, 32, 64, 512 rows (``--rows``) in bfloat16: the engine's bfloat16
linear (oneDNN on a weight packed once, as engine/cpu/linear.py runs it: a float32
copy where oneDNN has no bfloat16 on the host) against the
CPU quantized kernels (kernels/cpu_quant.py) on int8 and fp8 per-channel, fp8 128x128
blocks and int4 groups of 128, and where the host has AVX512_VNNI or AVX2 the W8A8 int8 kernel
(kernels/cpu_quant_int8.py: x quantized per token, integer products). Prints
milliseconds per call and bf16 / quantized.

``--mode model`` (default): bench_engine's Llama-shaped model at a size where the
decoder's linears dominate memory, served in bfloat16 from its float checkpoint, with
online FP8 and int8 (``quantization="fp8" | "int8"``), from a GPTQ int4 checkpoint
(groups of 128) and from a compressed-tensors W8A8 int8 checkpoint (per-channel
weights, inputs quantized per token), both written in their on-disk layouts by the
quantized-checkpoint tests' builder; ``--variants`` picks the formats run beside
bfloat16, among them "int8 asymmetric" (compressed-tensors ``symmetric: false``:
per-channel scales and int8 zero points, weight-only), not run by default. For each:
the resident weight bytes (every tensor the engine's model holds, oneDNN's packed
copies included), decode-heavy throughput (a few short prompts, many output tokens;
with its prompts' prefill step, timed alone too, as a share of the run and the decode
steps' ratio without it) and prefill throughput (long prompts, one output token), with
ratios to bfloat16. Runs are interleaved round by round and the best of each compared;
the ratios round by round (median and range) follow, since this host's slow phases
move bfloat16's memory-bound linears and the quantized compute-bound tiles differently.

    python bench/bench_quant.py [--mode model|kernel] [--hidden 1024] [--layers 12] [--repeat 2]
                                [--cpu-time] [--seqs 1,4,16,32,64] [--kv-cache-mib 512]
                                [--variants "int8,int8 asymmetric"]

``--seqs`` sweeps the decode workload over that many sequences decoding at once
(prompts of 8-24 tokens, ``--output-len`` tokens each) and prints each format's decode
throughput ratio to bfloat16 per count, beside the prefill comparison.

``--cpu-time`` runs on one thread timed by its CPU time (for a machine other work is
loading; the absolute figures are then one core's).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import build_bench_model, random_prompts, run_clock, scratch_dir

from shardline import LLM, SamplingParams
from shardline.engine.cpu.capability import host_cpu
from shardline.engine.cpu.linear import PackedLinear, onednn_linear_available
from shardline.engine.kernels.cpu_quant import cpu_w4_linear, cpu_w8_linear
from shardline.engine.kernels.cpu_quant_int8 import cpu_w8a8_available, cpu_w8a8_linear
from shardline.engine.llm_engine import LLMEngine

clock: Callable[[], float] = time.perf_counter
ROWS = (1, 4, 8, 16, 32, 64, 512)
# Model mode's formats run beside bf16 by default, and every one --variants may name.
VARIANTS = ("fp8", "int8", "int4 (GPTQ g128)", "w8a8 int8")
ALL_VARIANTS = (*VARIANTS, "int8 asymmetric")


def best_ms(call: Callable[[], object], repeats: int = 5) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        call()
        best = min(best, clock() - start)
    return best * 1e3


def kernel_calls(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    """The bf16 linear as the engine runs it (oneDNN on a packed copy: bfloat16, or
    float32 where oneDNN has no bfloat16 here, x widened and the output rounded back)
    and each quantized kernel, on x."""
    packed_dtype = torch.bfloat16 if onednn_linear_available(torch.bfloat16) else torch.float32
    onednn = torch.ops.mkldnn._reorder_linear_weight(weights["bf16"].to(packed_dtype), x.shape[0])
    calls: dict[str, Callable[[], object]] = {
        "bf16": lambda: torch.ops.mkldnn._linear_pointwise(x.to(packed_dtype), onednn, None, "none", [],
                                                           "").to(x.dtype),
        "int8": lambda: cpu_w8_linear(x, weights["int8"], weights["channel"]),
        "fp8": lambda: cpu_w8_linear(x, weights["fp8"], weights["channel"]),
        "fp8 128x128": lambda: cpu_w8_linear(x, weights["fp8"], weights["blocks"], (128, 128)),
        "int4 g128": lambda: cpu_w4_linear(x, weights["packed"], weights["groups"], weights["zeros"], 128),
    }
    if cpu_w8a8_available(x.dtype):
        calls["w8a8 int8"] = lambda: cpu_w8a8_linear(x, weights["int8"], weights["channel"])
    return calls


def layer_weights(rows: int, cols: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One linear's weight in bf16 and in each quantized layout, random."""
    return {
        "bf16": torch.randn(rows, cols, generator=generator).bfloat16() * 0.02,
        "int8": torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=generator),
        "fp8": (torch.randn(rows, cols, generator=generator) * 100).to(torch.float8_e4m3fn),
        "channel": torch.rand(rows, 1, generator=generator) * 1e-3,
        "blocks": torch.rand(-(-rows // 128), -(-cols // 128), generator=generator) * 1e-3,
        "packed": torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator),
        "groups": torch.rand(rows, cols // 128, generator=generator) * 1e-3,
        "zeros": torch.full((rows, cols // 128), 8.0),
    }


def per_call_ms(calls: list[dict[str, Callable[[], object]]], kind: str) -> float:
    """Milliseconds per call of ``kind``, one call on each copy of the weights in turn."""
    return best_ms(lambda: [call[kind]() for call in calls]) / len(calls)


def kernel_mode(hidden: int, intermediate: int, layers: int, row_counts: tuple[int, ...] = ROWS) -> None:
    """Each shape's weights in ``layers`` copies, read in turn as a decode step reads
    its layers' (so they come from memory, not from the cache, as in the model)."""
    generator = torch.Generator().manual_seed(0)
    for name, (rows, cols) in {"o_proj": (hidden, hidden), "gate_up": (2 * intermediate, hidden),
                               "down_proj": (hidden, intermediate)}.items():
        copies = [layer_weights(rows, cols, generator) for _ in range(layers)]
        for m in row_counts:
            x = torch.randn(m, cols, generator=generator).bfloat16()
            calls = [kernel_calls(x, weights) for weights in copies]
            times = {kind: per_call_ms(calls, kind) for kind in calls[0]}
            line = ", ".join(f"{kind} {ms:.3f} ms" + ("" if kind == "bf16" else f" ({times['bf16'] / ms:.2f}x)")
                             for kind, ms in times.items())
            print(f"{name:9s} [{rows}, {cols}] M={m:<4d} {line}", flush=True)


def write_int4_checkpoint(float_dir: str, group_size: int) -> str:
    """A GPTQ (v1, symmetric, no act-order) copy of ``float_dir``'s decoder linears."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.engine.quantization import checkpoints

    out_dir = scratch_dir("shardline-bench-gptq-")
    config = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}
    checkpoints.write_quantized(float_dir, out_dir, config, checkpoints.gptq(group_size, True))
    return out_dir


def write_w8a8_checkpoint(float_dir: str) -> str:
    """A compressed-tensors W8A8 int8 copy of ``float_dir``'s decoder linears (per-channel
    weights, dynamic per-token int8 inputs)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.engine.quantization import checkpoints

    out_dir = scratch_dir("shardline-bench-w8a8-")
    config = checkpoints.compressed_config(
        "int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True})
    checkpoints.write_quantized(float_dir, out_dir, config, checkpoints.int8_per_channel)
    return out_dir


def write_int8_asymmetric_checkpoint(float_dir: str) -> str:
    """A compressed-tensors asymmetric int8 copy of ``float_dir``'s decoder linears
    (``symmetric: false``: per-channel scales and int8 zero points, weight-only)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.engine.quantization import checkpoints

    out_dir = scratch_dir("shardline-bench-int8-asym-")
    config = checkpoints.compressed_config(
        "int-quantized", {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"})
    checkpoints.write_quantized(float_dir, out_dir, config, checkpoints.int8_asymmetric(per_channel=True))
    return out_dir


def weight_bytes(llm: LLM) -> tuple[int, int]:
    """Bytes of every tensor the engine's model holds (each storage once), and of
    oneDNN's packed copies of its linears (opaque tensors: element count times size)."""
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine), type(engine)
    model = engine.model
    seen: set[int] = set()
    held = packed = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held += storage.nbytes()
    for module in model.modules():
        if isinstance(module, PackedLinear):  # oneDNN's opaque tensor (the small-rows kernel reads its memory)
            weight = module.packed_weight
            tensor = weight if isinstance(weight, torch.Tensor) else weight.onednn
            packed += tensor.numel() * tensor.element_size()
    return held, packed


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    start = clock()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = clock() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return elapsed


def model_mode(args: argparse.Namespace) -> None:
    overrides = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                     num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                     vocab_size=args.vocab)
    float_dir = build_bench_model(**overrides)
    checkpoints = {"int4 (GPTQ g128)": lambda: write_int4_checkpoint(float_dir, 128),
                   "w8a8 int8": lambda: write_w8a8_checkpoint(float_dir),
                   "int8 asymmetric": lambda: write_int8_asymmetric_checkpoint(float_dir)}
    online = {"bf16": None, "fp8": "fp8", "int8": "int8"}
    names = ["bf16", *(name for name in args.variants.split(",") if name != "bf16")]
    unknown = [name for name in names if name not in online and name not in checkpoints]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}: choose from {[*online, *checkpoints]}")
    variants = {name: (float_dir, online[name]) if name in online else (checkpoints[name](), None)
                for name in names}
    engines, memory = {}, {}
    for name, (directory, quantization) in variants.items():
        llm = LLM(directory, dtype="bfloat16", quantization=quantization,
                  kv_cache_memory_bytes=args.kv_cache_mib << 20)
        llm.generate({"prompt_token_ids": [5] * 8}, SamplingParams(max_tokens=2), use_tqdm=False)
        engines[name], memory[name] = llm, weight_bytes(llm)
        gc.collect()
    decode_prompts = random_prompts(args.decode_prompts, 8, 24, args.vocab, seed=1)
    prefill_prompts = random_prompts(args.prefill_prompts, args.prefill_len, args.prefill_len, args.vocab, seed=2)
    # "decode prompts": the decode workload's own prompts with one output token, the
    # prefill step its run includes, so the decode steps' share can be told apart.
    workloads = {"decode": (decode_prompts, args.output_len), "decode prompts": (decode_prompts, 1),
                 "prefill": (prefill_prompts, 1)}
    sweep = [int(count) for count in args.seqs.split(",")] if args.seqs else []
    for count in sweep:
        workloads[f"decode x{count}"] = (random_prompts(count, 8, 24, args.vocab, seed=3), args.output_len)
    seconds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeat):  # interleaved: a slow phase of the machine hits every variant
        for workload, (prompts, max_tokens) in workloads.items():
            for name, llm in engines.items():
                with torch.inference_mode():
                    seconds.setdefault((workload, name), []).append(run(llm, prompts, max_tokens))
    print(f"host: {host_cpu().describe()}")
    print(f"model: Llama-shaped, {overrides}, bfloat16 activations, {torch.get_num_threads()} threads")
    print(f"decode: {len(decode_prompts)} prompts of 8-24 tokens, {args.output_len} output tokens each; "
          f"prefill: {len(prefill_prompts)} prompts of {args.prefill_len} tokens, 1 output token; "
          f"{args.repeat} interleaved round(s), best of each")
    decode_tokens = len(decode_prompts) * args.output_len
    prefill_tokens = sum(len(p) for p in prefill_prompts)
    base_decode, base_prefill = min(seconds[("decode", "bf16")]), min(seconds[("prefill", "bf16")])
    base_held, base_packed = memory["bf16"]
    for name in engines:
        decode, prefill = min(seconds[("decode", name)]), min(seconds[("prefill", name)])
        held, packed = memory[name]
        decode_runs, prefill_runs = (", ".join(f"{s:.2f}" for s in seconds[(workload, name)])
                                     for workload in ("decode", "prefill"))
        print(f"{name:17s} weights {held / 2**20:6.1f} MiB ({held / base_held:.0%} of bf16's; with oneDNN's packed "
              f"copies {(held + packed) / 2**20:6.1f} MiB, {(held + packed) / (base_held + base_packed):.0%})  "
              f"decode {decode_tokens / decode:6.1f} tok/s ({base_decode / decode:.2f}x"
              f"{rounds(seconds, 'decode', name)}, runs {decode_runs} s)  "
              f"{decode_steps(seconds, name)}  "
              f"prefill {prefill_tokens / prefill:6.1f} tok/s ({base_prefill / prefill:.2f}x"
              f"{rounds(seconds, 'prefill', name)}, runs {prefill_runs} s)")
    if sweep:
        print_sweep(sweep, list(engines), seconds, args.output_len)


def decode_steps(seconds: dict[tuple[str, str], list[float]], name: str) -> str:
    """The decode workload's prompts' prefill (its best run with one output token) as a
    share of its best run, and the decode steps' ratio to bf16 without it."""
    def parts(variant: str) -> tuple[float, float]:
        return min(seconds[("decode", variant)]), min(seconds[("decode prompts", variant)])

    whole, prompts = parts(name)
    line = f"(its prompts' prefill {prompts:.3f} s, {prompts / whole:.0%} of the run"
    base_whole, base_prompts = parts("bf16")
    if name != "bf16" and whole > prompts and base_whole > base_prompts:
        line += f"; decode steps alone {(base_whole - base_prompts) / (whole - prompts):.2f}x"
    return line + ")"


def rounds(seconds: dict[tuple[str, str], list[float]], workload: str, name: str) -> str:
    """The ratios to bf16 round by round (each round's bf16 run over this variant's, run
    just after it), as their median and range: a slow phase of the host that spans a
    round moves both of its runs, where the best of each may come from different ones."""
    if name == "bf16":
        return ""
    ratios = sorted(base / run for base, run in zip(seconds[(workload, "bf16")], seconds[(workload, name)]))
    return f"; rounds median {statistics.median(ratios):.2f}x, {ratios[0]:.2f}-{ratios[-1]:.2f}x"


def print_sweep(sweep: list[int], names: list[str], seconds: dict[tuple[str, str], list[float]],
                output_len: int) -> None:
    """One line per count of sequences decoding: bfloat16's decode tokens per second and
    each format's ratio to it (best run of each)."""
    print(f"decode sweep: sequences decoding at once, {output_len} output tokens each; ratio to bf16")
    print(f"{'seqs':>5s} {'bf16 tok/s':>11s} " + " ".join(f"{name:>17s}" for name in names[1:]))
    for count in sweep:
        best = {name: min(seconds[(f"decode x{count}", name)]) for name in names}
        tokens = count * output_len
        print(f"{count:5d} {tokens / best['bf16']:11.1f} "
              + " ".join(f"{best['bf16'] / best[name]:16.2f}x" for name in names[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description="Quantized weights against bfloat16 on CPU")
    parser.add_argument("--mode", choices=["model", "kernel"], default="model")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--decode-prompts", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="each engine's KV cache (all are held at once)")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time")
    parser.add_argument("--seqs", default="", help="comma-separated counts of sequences decoding at once to sweep")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="kernel mode: comma-separated rows of x")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="model mode: comma-separated formats beside bf16 (" + ", ".join(ALL_VARIANTS) + ")")
    args = parser.parse_args()
    global clock
    clock = run_clock(args.cpu_time)
    if args.mode == "kernel":
        kernel_mode(args.hidden, args.intermediate, args.layers, tuple(int(m) for m in args.rows.split(",")))
    else:
        model_mode(args)


if __name__ == "__main__":
    main()
