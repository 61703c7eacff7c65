"""Per-linear micro-benchmark of the CPU small-batch kernel against oneDNN's packed linear.

    python bench/bench_small_linear.py [--rows 8 16 32 64] [--vocab 8192 32768] [--repeat 5]

For each linear shape of bench_engine's model (fused q/k/v, o, fused gate/up, down,
the LM head at each ``--vocab``) and each row count, on one thread timed by its CPU
time (best of ``--repeat``): copies of the weight packed by oneDNN, filling
STREAMED_BYTES (so each copy is read from memory, as a decode step reads every
weight once), multiplied one after the other by oneDNN's packed linear (as the
engine runs it) and by the kernel over the same packed bytes. Prints GFLOP/s of
each, the kernel's speedup, and each side's share of the limit: the larger of the
weight's bytes over the host's measured memory bandwidth and the arithmetic over
the single-core multiply-add peak (bench/fma_peak.c, built for the kernels'
target: SHARDLINE_CPU_TARGET=x86-64-v3 measures an AVX2 host's code). Both sides
pay their Python call, as in the engine. Each kernel run is checked against its
reference first.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import time
from pathlib import Path

import torch
from common import LLAMA_BENCH_CONFIG, best_cpu_seconds
from roofline import memory_bandwidth

from shardline.engine.cpu.linear import packed_matmul
from shardline.engine.kernels.cpu_small_linear import onednn_view, small_linear, small_linear_reference
from shardline.engine.kernels.native import NativeLibrary, declare

STREAMED_BYTES = 128 << 20


def _declare(library: ctypes.CDLL) -> None:
    declare(library, ["fma_peak_run"], [ctypes.c_int64, ctypes.POINTER(ctypes.c_float)], ctypes.c_double)


FMA_PEAK = NativeLibrary(Path(__file__).with_name("fma_peak.c"), _declare, "no peak")


def fma_peak(repeat: int) -> float:
    """The best multiply-add FLOP/s of one thread over ``repeat`` runs of about 0.1 s."""
    library = FMA_PEAK.load()
    assert library is not None, "bench/fma_peak.c builds with the kernels' compiler"
    sink = ctypes.c_float()
    best = 0.0
    for _ in range(repeat):
        start = time.thread_time()
        flops = library.fma_peak_run(10_000_000, ctypes.byref(sink))
        best = max(best, flops / (time.thread_time() - start))
    return best


def shapes(vocabs: list[int]) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of bench_engine's model's linears."""
    hidden, intermediate = LLAMA_BENCH_CONFIG["hidden_size"], LLAMA_BENCH_CONFIG["intermediate_size"]
    head_dim = hidden // LLAMA_BENCH_CONFIG["num_attention_heads"]
    kv = LLAMA_BENCH_CONFIG["num_key_value_heads"] * head_dim
    return [("qkv", hidden + 2 * kv, hidden), ("o", hidden, hidden), ("gate_up", 2 * intermediate, hidden),
            ("down", hidden, intermediate), *((f"lm_head {v // 1024}k", v, hidden) for v in vocabs)]


def bench_shape(name: str, out_features: int, in_features: int, args: argparse.Namespace,
                bandwidth: float, peak: float) -> None:
    weight = torch.randn(out_features, in_features)
    copies = max(1, STREAMED_BYTES // weight.nbytes)
    packed = [torch.ops.mkldnn._reorder_linear_weight(weight, 16) for _ in range(copies)]
    view = onednn_view(packed[0], weight)
    assert view is not None, "the kernel reads oneDNN's packed layout on this host"
    views = [dataclasses.replace(view, storage=copy) for copy in packed]
    for rows in args.rows:
        x = torch.randn(rows, in_features)
        torch.testing.assert_close(small_linear(x, views[0], None), small_linear_reference(x, weight, None),
                                   rtol=1e-4, atol=1e-4)
        onednn = best_cpu_seconds(lambda x=x: [packed_matmul(x, copy, None) for copy in packed], args.repeat,
                                  warm_up=True) / copies
        kernel = best_cpu_seconds(lambda x=x: [small_linear(x, copy, None) for copy in views], args.repeat,
                                  warm_up=True) / copies
        flops = 2 * rows * out_features * in_features
        limit = max(weight.nbytes / bandwidth, flops / peak)
        print(f"{name:<12} {out_features:>6}x{in_features:<5} {rows:>4}  oneDNN {flops / onednn / 1e9:6.1f} "
              f"({limit / onednn:4.0%})  kernel {flops / kernel / 1e9:6.1f} ({limit / kernel:4.0%})  "
              f"{onednn / kernel:4.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bandwidth = max(memory_bandwidth(time.thread_time).values())
    peak = fma_peak(args.repeat)
    print(f"one thread: memory bandwidth {bandwidth / 1e9:.1f} GB/s, multiply-add peak {peak / 1e9:.1f} GFLOP/s; "
          f"GFLOP/s (share of the limit: bytes / bandwidth or FLOPs / peak, the larger)")
    print(f"{'linear':<12} {'shape':<12} {'rows':>4}")
    with torch.inference_mode():
        for name, out_features, in_features in shapes(args.vocab):
            bench_shape(name, out_features, in_features, args, bandwidth, peak)


if __name__ == "__main__":
    main()
