"""Data parallelism on one CPU host: rows/s of one engine against N replicas, side by side.

The same shards (random-word prompts, greedy, fixed output length) run through this
process's ShardRunner with ``--threads`` torch threads, then through a
DataParallelRunner of ``--replicas`` replica processes with ``--threads`` threads each
(so N replicas use N times the cores: a scaling check, not a claim about one core).
CPU seconds per row (this process, and the replicas' from /proc) show the replicas'
overhead even on a host whose other work skews the wall clock.
Engine loads are outside the timed part; each side first runs a warm-up shard. Prints
rows/s for each, their ratio, each replica's share of the requests, and whether the
two sides' tokens agree row for row.

    python bench/bench_dp.py --replicas 2 --threads 1
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import build_bench_model  # noqa: E402

from shardline import SamplingParams  # noqa: E402
from shardline.tasks.data_parallel import DataParallelRunner  # noqa: E402
from shardline.tasks.engine_cache import load_runner  # noqa: E402
from shardline.tasks.executor import RowRequest, RowResult, ShardExecutor  # noqa: E402

WORDS = ("sea", "cache", "batch", "dog", "Tokyo", "poem", "river", "engine", "shard", "row", "token", "queue")


def make_shards(num_shards: int, rows: int, max_tokens: int, seed: int = 0) -> dict[str, list[RowRequest]]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return {f"part-{s:03d}": [RowRequest(i, " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))), None,
                                         params) for i in range(rows)] for s in range(num_shards)}


def run_all(executor: ShardExecutor, shards: dict[str, list[RowRequest]]) -> tuple[float, dict[str, list[RowResult]]]:
    """Every shard at once, one caller thread each (as shards in flight are); wall seconds and results."""
    results: dict[str, list[RowResult]] = {}
    threads = [threading.Thread(target=lambda k=key: results.__setitem__(k, executor.run_shard(k, shards[k])))
               for key in shards]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, results


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) this process and ``pids`` have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def tokens(results: dict[str, list[RowResult]]) -> dict[str, list[tuple[int, ...]]]:
    return {key: [tuple(r.output.outputs[0].token_ids) if r.output is not None else () for r in rows]  # type: ignore[union-attr]
            for key, rows in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32, help="rows per shard")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4, help="the benchmark model's decoder layers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_bench_model(num_hidden_layers=args.layers)
    options = {"max_num_seqs": args.max_num_seqs, "device": "cpu"}
    shards = make_shards(args.shards, args.rows, args.max_tokens)
    warm_up = make_shards(1, args.max_num_seqs, 4, seed=1)
    rows = args.shards * args.rows

    one = load_runner(model, options)
    run_all(one, warm_up)
    cpu_before = cpu_seconds([])
    one_seconds, one_results = run_all(one, shards)
    one_cpu = cpu_seconds([]) - cpu_before
    one.close()
    one.llm.close()

    replicated = DataParallelRunner(model, {**options}, args.replicas)
    try:
        run_all(replicated, warm_up)
        pids = [pid for pid in replicated.replica_pids() if pid is not None]
        cpu_before = cpu_seconds(pids)
        many_seconds, many_results = run_all(replicated, shards)
        many_cpu = cpu_seconds(pids) - cpu_before
        shares = [stats.get("requests_added", 0) for stats in replicated.replica_stats()]
    finally:
        replicated.close()

    load = os.getloadavg()[0]  # other work on the host skews a scaling check: printed beside it
    print(f"host: {os.cpu_count()} CPUs, load average {load:.1f}; {torch.get_num_threads()} torch thread(s) per "
          f"engine; {rows} rows in {args.shards} shards, "
          f"{args.max_tokens} tokens each, max_num_seqs {args.max_num_seqs}, {args.layers}-layer bench model")
    print(f"1 engine:      {rows / one_seconds:8.2f} rows/s ({one_seconds:.2f}s); {one_cpu / rows * 1000:.1f} "
          "CPU ms per row")
    print(f"{args.replicas} replicas:    {rows / many_seconds:8.2f} rows/s ({many_seconds:.2f}s); "
          f"{many_cpu / rows * 1000:.1f} "
          f"CPU ms per row (replicas and this process); requests per replica (warm-up included) {shares}")
    print(f"ratio replicas/1: {one_seconds / many_seconds:.2f}x; tokens agree row for row: "
          f"{tokens(one_results) == tokens(many_results)}")


if __name__ == "__main__":
    main()
