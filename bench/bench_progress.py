"""What progress reporting costs the engine loop: the runner with and without ``on_row``.

The same shards run through one ShardRunner on the tiny test model (the cheapest steps,
where a per-row cost weighs most), in turn with no progress, with a JobProgress fed by
every finished row whose sinks (a log line, a snapshot recorder) are due at the flow's
intervals (0.5 s and 10 s), and with both due at every row (the worst case),
``--repeat`` times; best against best. Also the cost of one row report alone
(``JobProgress.row_done`` with no sink due), in microseconds.

    python bench/bench_progress.py --rows 512 --repeat 3
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tiny_model
from shardline.tasks.executor import RowDone, RowRequest
from shardline.tasks.progress import JobProgress
from shardline.tasks.progress_report import log_sink
from shardline.tasks.runner import ShardRunner
from shardline.tasks.storage import Shard


def run_once(runner: ShardRunner, rows: list[RowRequest], shards: int, every: float | None) -> float:
    """Seconds to run ``rows``; ``every``: the sinks' interval (None: no progress at all)."""
    keys = [f"shard-{index}" for index in range(shards)]
    progress = JobProgress([Shard(f"file:///{key}", key, "parquet", 1) for key in keys])
    with_progress = every is not None
    if every is not None:
        progress.add_sink(log_sink(logging.getLogger("bench.progress")), every)
        progress.add_sink(lambda snapshot: None, every and 10.0)
    per_shard = len(rows) // shards
    started = time.perf_counter()
    for index, key in enumerate(keys):
        part = rows[index * per_shard:(index + 1) * per_shard]
        progress.shard_read(key, len(part))
        runner.run_shard(key, part, on_row=progress.on_row(key) if with_progress else None)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)  # the log sink formats its line, the handler drops it
    model = build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-progress-")), arch="llama")
    llm = LLM(str(model), max_num_seqs=64, seed=0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rows = [RowRequest(index, f"Row {index} of the benchmark", None, params) for index in range(args.rows)]
    runner = ShardRunner(llm)
    run_once(runner, rows[: args.shards * 8], args.shards, 0.0)  # warm-up
    plain, reported, worst = [], [], []
    for _ in range(args.repeat):
        plain.append(run_once(runner, rows, args.shards, None))
        reported.append(run_once(runner, rows, args.shards, 0.5))
        worst.append(run_once(runner, rows, args.shards, 0.0))
    runner.close()
    llm.close()

    progress = JobProgress([Shard("file:///x", "x", "parquet", 1)])
    progress.shard_read("x", 10**6)
    calls = 200_000
    started = time.perf_counter()
    for index in range(calls):
        progress.row_done("x", RowDone(index, 8, False))
    per_call = (time.perf_counter() - started) / calls * 1e6

    print(f"rows {args.rows} in {args.shards} shards, best of {args.repeat}: without progress {min(plain):.3f}s; "
          f"reported, sinks at 0.5 s and 10 s {min(reported):.3f}s (ratio {min(reported) / min(plain):.3f}); "
          f"every sink due at every row {min(worst):.3f}s (ratio {min(worst) / min(plain):.3f})")
    print(f"one row report with no sink due: {per_call:.2f} us")


if __name__ == "__main__":
    main()
