"""Micro-benchmark of the attention kernels: the Triton ones on a GPU, or with --cpu the C ones.

    python bench/bench_kernels.py [--head-dim 128] [--heads 32] [--kv-heads 8]
    python bench/bench_kernels.py --cpu [--repeat 5] [--prefill-sweep]

GPU: time per call and the KV bytes read per second (the decode roofline is memory
bandwidth) of paged attention (decode, prefill) and the KV store; needs a CUDA GPU.

--cpu --prefill-sweep: the C prefill kernel alone on one fresh prompt of 128-2048
rows, head sizes 64 and 128, 1-8 query heads per KV head (2 KV heads), float32 and
bfloat16: GFLOP/s (causal: 4 n (n + 1) / 2 H D) beside the host's float32 matmul
peak measured in the same process (bench/common.py's peak_matmul_flops).

--cpu: the C decode and prefill kernels (engine/kernels/cpu_*.c) on bench_engine's
heads (8 query heads over 4 KV heads of 64) and prompts: a decode step of its 64
requests halfway through their outputs, and one of the sweep's long-outputs shape (16
prompts of 32-128 tokens halfway through 512 outputs), each over 8 layers' caches
(more than the last-level cache holds, as in the engine) in float32 and in bfloat16,
with the block tables
shuffled and in the engine's order (each prompt's blocks in a row, then the decode
blocks taken by the requests in turn, as bench_engine's run lays them out), and its
64 prompts prefilled fresh. One thread, timed by its CPU time (best of --repeat), so runs on a
loaded machine compare; build targets by SHARDLINE_CPU_TARGET (e.g. x86-64-v3 for an
AVX2 host's code on an AVX-512 one). Prints ms per layer with GB/s of KV read
(decode, with its share of the host's one-thread read bandwidth, bench/roofline.py's
memory_bandwidth) and GFLOP/s (prefill).

--cpu --baseline REV: the decode (engine order) and prefill shapes of --cpu with the
kernels' sources at git revision REV beside the working tree's, built for the same
target and run alternately round by round in one process (best of --repeat each),
with the working tree's speed over REV's: how a kernel change is judged on a machine
whose speed swings between runs.

Each kernel is checked against its reference first.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
from common import LLAMA_BENCH_CONFIG, best_cpu_seconds, random_prompts

from shardline.engine.kernels import (
    paged_attention,
    paged_attention_reference,
    store_kv_cache,
    triton_available,
)


def make_batch(context_lens, query_lens, args, device):
    """Random paged caches and queries; block ids shuffled across sequences."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // args.block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    block_ids = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32,
                               device=device)
    start = 0
    for seq, n in enumerate(blocks_per_seq):
        block_tables[seq, :n] = block_ids[start:start + n]
        start += n
    cache_shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(cache_shape, dtype=args.dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=args.dtype, device=device)
    q = torch.randn(sum(query_lens), args.heads, args.head_dim, dtype=args.dtype, device=device)
    query_start_loc = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return (q, k_cache, v_cache, query_start_loc, seq_lens_t, block_tables), sum(seq_lens)


def bench_attention(name, context_lens, query_lens, args):
    import triton.testing

    batch, num_keys = make_batch(context_lens, query_lens, args, "cuda")
    scale = args.head_dim ** -0.5
    max_query_len = max(query_lens)
    out = paged_attention(*batch, scale, max_query_len=max_query_len)
    expected = paged_attention_reference(*batch, scale)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    ms = triton.testing.do_bench(
        lambda: paged_attention(*batch, scale, max_query_len=max_query_len))
    kv_bytes = 2 * num_keys * args.kv_heads * args.head_dim * batch[0].element_size()
    print(f"{name:<34} {ms * 1e3:9.1f} us  {kv_bytes / ms / 1e6:8.1f} GB/s of KV")


def bench_store(num_tokens, args):
    import triton.testing

    num_blocks = -(-num_tokens // args.block_size)
    k = torch.randn(num_tokens, args.kv_heads, args.head_dim, dtype=args.dtype, device="cuda")
    v = torch.randn_like(k)
    k_cache = torch.zeros(num_blocks, args.block_size, args.kv_heads, args.head_dim,
                          dtype=args.dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * args.block_size, device="cuda")[:num_tokens]
    ms = triton.testing.do_bench(lambda: store_kv_cache(k, v, k_cache, v_cache, slots))
    moved = 4 * k.numel() * k.element_size()  # read and write, k and v
    print(f"{f'store_kv_cache T={num_tokens}':<34} {ms * 1e3:9.1f} us  "
          f"{moved / ms / 1e6:8.1f} GB/s moved")


def cpu_batch(lengths: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, layers: int):
    """Shuffled block tables for requests of ``lengths`` tokens and ``layers`` random KV caches."""
    blocks = [-(-n // block_size) for n in lengths]
    generator = torch.Generator().manual_seed(0)
    block_ids = torch.randperm(sum(blocks), generator=generator).to(torch.int32)
    block_tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    for seq, (start, count) in enumerate(zip([0, *itertools.accumulate(blocks)], blocks)):
        block_tables[seq, :count] = block_ids[start:start + count]
    shape = (sum(blocks), block_size, kv_heads, head_dim)
    caches = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
              for _ in range(layers)]
    return block_tables, caches


def engine_order_tables(prompts: list[int], lengths: list[int], block_size: int) -> torch.Tensor:
    """Block tables as the engine's allocator lays out bench_engine's run: each prompt's
    blocks one after another, then the decoding requests' new blocks in turn."""
    prompt_blocks = [-(-n // block_size) for n in prompts]
    blocks = [-(-n // block_size) for n in lengths]
    block_tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    next_block = 0
    for seq, count in enumerate(prompt_blocks):
        block_tables[seq, :count] = torch.arange(next_block, next_block + count)
        next_block += count
    for index in range(max(blocks)):
        for seq in range(len(lengths)):
            if prompt_blocks[seq] <= index < blocks[seq]:
                block_tables[seq, index] = next_block
                next_block += 1
    return block_tables


def bench_cpu_decode(prompts: list[int], outputs_done: int, bandwidth: float, repeat: int) -> None:
    """The decode kernel on requests ``outputs_done`` tokens past their ``prompts``, over
    8 layers' caches in float32 and in bfloat16, its block tables shuffled and in the
    engine's order."""
    from shardline.engine.kernels.cpu_attention import decode_attention

    heads, kv_heads = LLAMA_BENCH_CONFIG["num_attention_heads"], LLAMA_BENCH_CONFIG["num_key_value_heads"]
    head_dim, block_size, layers = LLAMA_BENCH_CONFIG["hidden_size"] // heads, 16, 8
    scale = head_dim ** -0.5
    lengths = [n + outputs_done for n in prompts]
    block_tables, float_caches = cpu_batch(lengths, heads, kv_heads, head_dim, block_size, layers)
    float_query = torch.randn(len(lengths), heads, head_dim)
    seq_lens, rows = torch.tensor(lengths), torch.arange(len(lengths))
    tables = (("shuffled", block_tables), ("engine order", engine_order_tables(prompts, lengths, block_size)))
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        caches = [(k.to(dtype), v.to(dtype)) for k, v in float_caches]
        query = float_query.to(dtype)
        out = torch.empty_like(query)
        k_cache, v_cache = caches[0]
        decode_attention(query, k_cache, v_cache, block_tables, seq_lens, rows, rows, out, scale)
        expected = paged_attention_reference(query.float(), k_cache.float(), v_cache.float(),
                                             torch.cat([rows, rows[-1:] + 1]), seq_lens, block_tables, scale)
        torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
        kv_bytes = 2 * sum(lengths) * kv_heads * head_dim * dtype.itemsize
        for order, order_tables in tables:
            seconds = best_cpu_seconds(lambda order_tables=order_tables, query=query, out=out, caches=caches: [
                decode_attention(query, k, v, order_tables, seq_lens, rows, rows, out, scale) for k, v in caches],
                repeat) / layers
            label = f"decode {len(lengths)} x {sum(lengths) // len(lengths)} ctx, {order}, {str(dtype)[6:]}"
            print(f"{label:<44} {seconds * 1e3:8.2f} ms/layer {kv_bytes / seconds / 1e9:7.1f} GB/s of KV "
                  f"({100 * kv_bytes / seconds / bandwidth:3.0f}% of the read bandwidth)")


def bench_cpu(repeat: int) -> None:
    """The C decode and prefill kernels on bench_engine's workloads (see the module docstring)."""
    from roofline import memory_bandwidth

    from shardline.engine.cpu.capability import host_cpu
    from shardline.engine.kernels.cpu_prefill_attention import prefill_attention

    torch.set_num_threads(1)
    heads, kv_heads = LLAMA_BENCH_CONFIG["num_attention_heads"], LLAMA_BENCH_CONFIG["num_key_value_heads"]
    head_dim = LLAMA_BENCH_CONFIG["hidden_size"] // heads
    prompts = [len(p) for p in random_prompts(64, 32, 512, LLAMA_BENCH_CONFIG["vocab_size"])]
    scale = head_dim ** -0.5
    bandwidth = memory_bandwidth(time.thread_time, 256 << 20)["read"]  # one thread, as the kernels are timed
    print(f"host: {host_cpu().describe()}; one thread, CPU time, best of {repeat}; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    bench_cpu_decode(prompts, 64, bandwidth, repeat)  # the default workload, halfway through 128 outputs
    long_outputs = [len(p) for p in random_prompts(16, 32, 128, LLAMA_BENCH_CONFIG["vocab_size"])]
    bench_cpu_decode(long_outputs, 256, bandwidth, repeat)  # the sweep's long outputs, halfway through 512

    block_tables, [(k_cache, v_cache)] = cpu_batch(prompts, heads, kv_heads, head_dim, 16, 1)
    query = torch.randn(sum(prompts), heads, head_dim)
    out = torch.empty_like(query)
    query_start_loc, seq_lens = torch.tensor([0, *itertools.accumulate(prompts)]), torch.tensor(prompts)
    requests = torch.arange(len(prompts))
    prefill_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, requests, out, scale)
    expected = paged_attention_reference(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    seconds = best_cpu_seconds(lambda: prefill_attention(query, k_cache, v_cache, block_tables, query_start_loc,
                                                         seq_lens, requests, out, scale), repeat)
    flops = sum(n * (n + 1) // 2 for n in prompts) * heads * head_dim * 4  # causal: q.k and p.v
    print(f"{'prefill 64 prompts fresh':<44} {seconds * 1e3:8.2f} ms/layer {flops / seconds / 1e9:7.1f} GFLOP/s")


def bench_prefill_sweep(repeat: int) -> None:
    """The C prefill kernel's GFLOP/s by prompt rows, head size, query heads per KV head
    and dtype (see the module docstring), with the matmul peak beside it."""
    from common import peak_matmul_flops

    from shardline.engine.cpu.capability import host_cpu
    from shardline.engine.kernels.cpu_prefill_attention import prefill_attention

    torch.set_num_threads(1)
    row_counts, kv_heads, block_size = (128, 512, 1024, 2048), 2, 16
    peak = max(peak_matmul_flops(torch.float32, clock=time.thread_time).values())
    print(f"host: {host_cpu().describe()}; one thread, CPU time, best of {repeat}; "
          f"float32 matmul peak {peak / 1e9:.1f} GFLOP/s")
    print(f"{'dtype':9s} {'D':>4s} {'G':>3s} " + " ".join(f"{f'{rows} rows':>14s}" for rows in row_counts))
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim, group in itertools.product((64, 128), (1, 2, 4, 8)):
            cells = []
            for rows in row_counts:
                block_tables, [(k_cache, v_cache)] = cpu_batch([rows], group * kv_heads, kv_heads, head_dim,
                                                               block_size, 1)
                k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
                query = torch.randn(rows, group * kv_heads, head_dim).to(dtype)
                out = torch.empty_like(query)
                args = (query, k_cache, v_cache, block_tables, torch.tensor([0, rows]), torch.tensor([rows]),
                        torch.tensor([0]), out, head_dim ** -0.5)
                prefill_attention(*args)
                seconds = best_cpu_seconds(lambda args=args: prefill_attention(*args), repeat)
                flops = rows * (rows + 1) // 2 * group * kv_heads * head_dim * 4
                cells.append(f"{flops / seconds / 1e9:6.1f} ({100 * flops / seconds / peak:3.0f}%)")
            print(f"{str(dtype).split('.')[1]:9s} {head_dim:4d} {group:3d} " + " ".join(f"{c:>14s}" for c in cells),
                  flush=True)
    print("(GFLOP/s, and its share of the float32 matmul peak)")


def baseline_libraries(revision: str) -> dict[str, object]:
    """The decode and prefill kernels' libraries built from their sources at git
    ``revision`` (every C file and header of engine/kernels copied to a scratch
    directory) with the engine's build flags for the current target, uncached: the
    engine's library cache keys a source by the working tree's headers."""
    import ctypes
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    from shardline.engine.kernels import cpu_attention, cpu_prefill_attention
    from shardline.engine.kernels.native import BUILD_FLAGS, PAGED_ATTENTION_ARGTYPES, declare, kernel_target

    kernels = Path(cpu_attention.__file__).parent
    scratch = Path(tempfile.mkdtemp(prefix="shardline-baseline-"))
    names = subprocess.run(["git", "ls-tree", "--name-only", revision, "./"], cwd=kernels, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in (n for n in names if n.endswith((".c", ".h"))):
        source = subprocess.run(["git", "show", f"{revision}:./{name}"], cwd=kernels, check=True,
                                capture_output=True).stdout
        (scratch / name).write_bytes(source)
    libraries = {}
    for source, function, extra in ((cpu_attention.SOURCE, "decode_attention_f32", []),
                                    (cpu_prefill_attention.SOURCE, "prefill_attention_f32", [ctypes.c_void_p])):
        output = scratch / f"{source.stem}.so"
        subprocess.run([os.environ.get("CC") or "cc", *BUILD_FLAGS, f"-march={kernel_target()}",
                        str(scratch / source.name), "-o", str(output), "-lm"], check=True, capture_output=True)
        library = ctypes.CDLL(str(output))
        declare(library, [function], [*PAGED_ATTENTION_ARGTYPES, *extra], None if not extra else ctypes.c_int)
        libraries[source.name] = library
    return libraries


def bench_baseline(revision: str, repeat: int) -> None:
    """The working tree's decode and prefill kernels against ``revision``'s, alternately."""
    from shardline.engine.kernels import cpu_attention, cpu_prefill_attention
    from shardline.engine.kernels.native import call_paged_attention

    torch.set_num_threads(1)
    baseline = baseline_libraries(revision)
    current = {module.SOURCE.name: module.load_library() for module in (cpu_attention, cpu_prefill_attention)}
    heads, kv_heads = LLAMA_BENCH_CONFIG["num_attention_heads"], LLAMA_BENCH_CONFIG["num_key_value_heads"]
    head_dim, vocab = LLAMA_BENCH_CONFIG["hidden_size"] // heads, LLAMA_BENCH_CONFIG["vocab_size"]
    cases = []  # (label, kernel source, calls: (query, k, v, tables, index arrays, requests, out) each)
    for prompts, done in (([len(p) for p in random_prompts(64, 32, 512, vocab)], 64),
                          ([len(p) for p in random_prompts(16, 32, 128, vocab)], 256)):
        lengths = [n + done for n in prompts]
        _, caches = cpu_batch(lengths, heads, kv_heads, head_dim, 16, 8)
        tables, rows = engine_order_tables(prompts, lengths, 16), torch.arange(len(lengths))
        query = torch.randn(len(lengths), heads, head_dim)
        calls = [(query, k, v, tables, (torch.tensor(lengths), rows), rows, torch.empty_like(query))
                 for k, v in caches]
        cases.append((f"decode {len(lengths)} x {sum(lengths) // len(lengths)} ctx, 8 layers",
                      cpu_attention.SOURCE.name, "decode_attention_f32", (), calls))
    prompts = [len(p) for p in random_prompts(64, 32, 512, vocab)]
    tables, [(k, v)] = cpu_batch(prompts, heads, kv_heads, head_dim, 16, 1)
    query = torch.randn(sum(prompts), heads, head_dim)
    starts = torch.tensor([0, *itertools.accumulate(prompts)])
    cases.append(("prefill 64 prompts fresh", cpu_prefill_attention.SOURCE.name, "prefill_attention_f32", (None,),
                  [(query, k, v, tables, (starts, torch.tensor(prompts)), torch.arange(64), torch.empty_like(query))]))
    print(f"one thread, CPU time, best of {repeat} each, alternating; working tree against {revision}")
    for label, source, function, extra, calls in cases:
        def run(library, calls=calls, function=function, extra=extra):
            for query, k, v, tables, indices, requests, out in calls:
                call_paged_attention(getattr(library, function), query, k, v, tables, indices, requests, out,
                                     head_dim ** -0.5, None, None, extra=extra)
        best = {"tree": float("inf"), revision: float("inf")}
        for round_index in range(repeat):
            sides = [("tree", current[source]), (revision, baseline[source])]
            for side, library in sides[::-1] if round_index % 2 else sides:
                best[side] = min(best[side], best_cpu_seconds(lambda library=library: run(library), 1, True))
        print(f"{label:<34} {revision} {best[revision] * 1e3:8.2f} ms, tree {best['tree'] * 1e3:8.2f} ms: "
              f"{best[revision] / best['tree']:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the C kernels on bench_engine's workload")
    parser.add_argument("--repeat", type=int, default=5, help="--cpu: timed runs of each kernel, best taken")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="--cpu: the prefill kernel by rows, head size, query heads per KV head and dtype")
    parser.add_argument("--baseline", metavar="REV",
                        help="--cpu: the working tree's kernels against those at git revision REV, alternately")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    if args.cpu:
        if args.baseline:
            bench_baseline(args.baseline, args.repeat)
        elif args.prefill_sweep:
            bench_prefill_sweep(args.repeat)
        else:
            bench_cpu(args.repeat)
        return
    args.dtype = getattr(torch, args.dtype)
    if not (torch.cuda.is_available() and triton_available()):
        raise SystemExit("bench_kernels needs a CUDA GPU and triton")
    torch.manual_seed(0)
    bench_attention("decode 64 seqs x 1024 ctx", [1023] * 64, [1] * 64, args)
    bench_attention("decode 256 seqs x 2048 ctx", [2047] * 256, [1] * 256, args)
    bench_attention("prefill 8 x 1024 fresh", [0] * 8, [1024] * 8, args)
    bench_attention("prefill chunk 4 x 512 on 1536 ctx", [1536] * 4, [512] * 4, args)
    bench_attention("mixed 4 x 512 chunks + 128 decodes", [1536] * 4 + [1023] * 128,
                    [512] * 4 + [1] * 128, args)
    bench_store(8192, args)


if __name__ == "__main__":
    main()
