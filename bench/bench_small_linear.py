"""Per-linear micro-benchmark of the CPU small-batch kernel against oneDNN's packed linear
and torch's matmul.

    python bench/bench_small_linear.py [--rows 8 16 32 64 256 2048] [--vocab 8192 32768] [--repeat 5]

For each linear shape of bench_engine's model (fused q/k/v, o, fused gate/up, down,
the LM head at each ``--vocab``) and each row count, on one thread timed by its CPU
time (best of ``--repeat``, the three sides interleaved round by round): copies of
the weight packed by oneDNN, filling STREAMED_BYTES (so each copy is read from
memory, as a decode step reads every weight once), multiplied one after the other
by oneDNN's packed linear (as the engine runs it), by the kernel over the same
packed bytes and by torch's matmul (F.linear) on the plain weight. Past
STREAMED_ROWS rows (a prefill step's, bound by the arithmetic) one copy runs.
Prints GFLOP/s of each, the kernel's speedup over oneDNN, and each side's share of
the limit: the larger of the weight's bytes over the host's measured memory
bandwidth and the arithmetic over the single-core multiply-add peak
(bench/fma_peak.c, built for the kernels' target: SHARDLINE_CPU_TARGET=x86-64-v3
measures an AVX2 host's code). Every side pays its Python call, as in the engine.
Each kernel run is checked against its reference first.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from common import LLAMA_BENCH_CONFIG
from roofline import memory_bandwidth

from shardline.engine.config import DEFAULT_TOKEN_BUDGETS
from shardline.engine.cpu.linear import packed_matmul
from shardline.engine.kernels.cpu_small_linear import onednn_view, small_linear, small_linear_reference
from shardline.engine.kernels.native import NativeLibrary, declare

STREAMED_BYTES = 128 << 20
# Past this many rows a linear is bound by its arithmetic wherever its weight comes
# from: one copy runs (copies filling STREAMED_BYTES would take minutes).
STREAMED_ROWS = 64
# The rows oneDNN packs the weights for: the engine's CPU token budget (its rows_hint).
ROWS_HINT = DEFAULT_TOKEN_BUDGETS["cpu"]


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
    streamed = max(1, STREAMED_BYTES // weight.nbytes)
    plain = [weight.clone() for _ in range(streamed)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(copy, ROWS_HINT) for copy in plain]
    view = onednn_view(packed[0], weight)
    assert view is not None, "the kernel reads oneDNN's packed layout on this host"
    views = [dataclasses.replace(view, storage=copy) for copy in packed]
    for rows in args.rows:
        copies = streamed if rows <= STREAMED_ROWS else 1
        x = torch.randn(rows, in_features)
        torch.testing.assert_close(small_linear(x, views[0], None), small_linear_reference(x, weight, None),
                                   rtol=1e-4, atol=1e-3)
        sides = {"oneDNN": lambda x=x, copies=copies: [packed_matmul(x, copy, None) for copy in packed[:copies]],
                 "kernel": lambda x=x, copies=copies: [small_linear(x, copy, None) for copy in views[:copies]],
                 "torch": lambda x=x, copies=copies: [F.linear(x, copy) for copy in plain[:copies]]}
        seconds = interleaved_best(sides, args.repeat)
        flops = 2 * rows * out_features * in_features
        limit = max(weight.nbytes / bandwidth, flops / peak)
        figures = "  ".join(f"{side} {flops * copies / time_ / 1e9:6.1f} ({limit * copies / time_:4.0%})"
                            for side, time_ in seconds.items())
        print(f"{name:<12} {out_features:>6}x{in_features:<5} {rows:>5}  {figures}  "
              f"{seconds['oneDNN'] / seconds['kernel']:4.2f}x", flush=True)


def interleaved_best(sides: Mapping[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Each side's least CPU time of this thread over ``repeat`` rounds, the sides run
    one after the other in every round (a slow phase of the machine hits all), after
    one untimed call each."""
    for run in sides.values():
        run()
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(repeat):
        for side, run in sides.items():
            start = time.thread_time()
            run()
            best[side] = min(best[side], time.thread_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 256, 2048])
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
