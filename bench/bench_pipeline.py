"""Pipeline overhead: (flow wall time - engine-only time) / engine-only time, over 16 shards.

Engine-only: ``LLM(model)`` plus one ``generate`` over every prompt of the dataset
(after an untimed warm-up run, so first-use costs of torch count in neither).
CPU seconds are printed beside each run (this process, the whole machine, and time
the host stole from this machine's CPUs), to tell contention from waiting, and a
step trace: start-up before the first step, time in steps, gaps between steps (a
starved engine) and wind-down after the last.

Flow: ``batch_inference`` over the same prompts split into shards (local Parquet and
JSON Lines), under a warm Prefect API (a temporary test server, started and warmed
before timing), including listing, done checks, reads, writes, manifests, artifacts
and the engine load. Same engine options, greedy, fixed output length.

The flow (its engine driven by a thread of the flow process, the default engine
host) runs into a fresh output prefix each time, interleaved with the engine-only
baseline, ``--repeat`` times. The overhead compares best with best (this machine's
speed swings between runs; the best run is the least disturbed).

Beside the wall-time overhead it prints the overhead outside engine steps (the
flow's wall time less its time inside engine steps, against the same for the
baseline: listing, done checks, reads, writes, task and flow start and end), which
the machine's speed swings barely move, and the ratio of time inside steps (steps
slowed by Prefect's threads and server sharing the CPUs).

Prefect's own cost per flow run is fixed, so with small shards it weighs more;
``--rows 32`` measures that case against the default 128 rows a shard.

    python bench/bench_pipeline.py                  # the benchmark model (8 layers, 512 wide)
    python bench/bench_pipeline.py --model tiny     # the 2-layer test model: Prefect-bound
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build_model(kind: str, root: Path) -> str:
    if kind == "tiny":
        from shardline.engine.model.tiny import build_tiny_model

        return str(build_tiny_model(root / "tiny"))
    from common import build_bench_model

    return build_bench_model(root / "bench")


class CpuMeter:
    """CPU seconds over a block: this process (all threads), the whole machine
    (every process: Prefect's server too) and time stolen by the host."""

    def __enter__(self) -> CpuMeter:
        self._start = (time.process_time(), *machine_cpu())
        return self

    def __exit__(self, *exc_info) -> None:
        end = (time.process_time(), *machine_cpu())
        self.process_s, self.machine_busy_s, self.steal_s = (round(b - a, 2) for a, b in zip(self._start, end))

    def as_dict(self) -> dict:
        return {"process_cpu_s": self.process_s, "machine_busy_cpu_s": self.machine_busy_s, "steal_s": self.steal_s}


def machine_cpu() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of this machine since boot, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = [int(value) for value in stat.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


class StepTrace:
    """Times of every engine step in this process: when the first step began, time
    inside steps, between steps and after the last one, so a flow's overhead splits
    into start-up, a starved or slower engine, and wind-down."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []

    def __enter__(self) -> StepTrace:
        from shardline.engine.llm_engine import LLMEngine

        self._step, steps = LLMEngine.step, self.steps

        def traced(engine):
            started = time.perf_counter()
            try:
                return self._step(engine)
            finally:
                steps.append((started, time.perf_counter()))

        LLMEngine.step = traced
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc_info) -> None:
        from shardline.engine.llm_engine import LLMEngine

        LLMEngine.step = self._step
        self.ended = time.perf_counter()

    def as_dict(self) -> dict:
        if not self.steps:
            return {"steps": 0}
        gaps = sum(b[0] - a[1] for a, b in zip(self.steps, self.steps[1:]))
        return {"steps": len(self.steps), "first_step_after_s": round(self.steps[0][0] - self.started, 2),
                "in_steps_s": round(sum(end - start for start, end in self.steps), 2),
                "between_steps_s": round(gaps, 2), "after_last_step_s": round(self.ended - self.steps[-1][1], 2)}


def engine_only_seconds(model: str, prompts: list[str], max_tokens: int, engine_options: dict) -> float:
    from shardline import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model, **engine_options)
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - started
    llm.close()
    return seconds


def flow_seconds(job) -> tuple[float, dict]:
    from shardline.flows.batch_inference import batch_inference

    started = time.perf_counter()
    summary = batch_inference(job)
    return time.perf_counter() - started, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["bench", "tiny"], default="bench")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--rows", type=int, default=128, help="rows per shard")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--shards-in-flight", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs of each; best against best")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    from prefect import flow
    from prefect.testing.utilities import prefect_test_harness

    # Torch work runs on threads that end, so this main thread holds no OpenMP pool
    # that would slow the flow's engine (see run_on_passing_thread).
    from shardline.tasks.engine_cache import run_on_passing_thread
    from shardline.tasks.job import BatchJob
    from shardline.tasks.sample_data import sample_prompts, write_rows

    root = Path(tempfile.mkdtemp(prefix="shardline-bench-pipeline-"))
    model = run_on_passing_thread(lambda: build_model(args.model, root))
    shards = [sample_prompts(args.rows, index) for index in range(args.shards)]
    for index, rows in enumerate(shards):
        write_rows(str(root / "in" / f"part-{index:05d}.{'parquet' if index % 2 == 0 else 'jsonl'}"), rows)
    prompts = [row["prompt"] for rows in shards for row in rows]
    engine_options = {"max_num_seqs": args.max_num_seqs}

    def engine_only(rows: list[str]) -> float:
        return run_on_passing_thread(lambda: engine_only_seconds(model, rows, args.max_tokens, engine_options))

    with prefect_test_harness(server_startup_timeout=120):
        flow(lambda: None, name="warm-up")()  # the API server is up and warm before timing
        engine_only(prompts[: args.max_num_seqs])  # torch warm-up
        engine_runs, flow_runs = [], []
        for attempt in range(args.repeat):  # interleaved, so a slow spell of the machine hits both
            with CpuMeter() as cpu, StepTrace() as trace:
                seconds = engine_only(prompts)
            steps = trace.as_dict()
            engine_runs.append({"wall_s": round(seconds, 3), "in_engine_steps_s": steps["in_steps_s"],
                                "outside_steps_s": round(seconds - steps["in_steps_s"], 3), "cpu": cpu.as_dict(),
                                "steps": steps})
            job = BatchJob(input=str(root / "in"), output=str(root / f"out-{attempt}"), model=model,
                           sampling={"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True},
                           engine_options=engine_options, shards_in_flight=args.shards_in_flight)
            with CpuMeter() as cpu, StepTrace() as trace:
                wall, summary = flow_seconds(job)
            assert summary["totals"]["rows"] == len(prompts) and summary["totals"]["errors"] == 0
            steps = trace.as_dict()
            flow_runs.append({
                "wall_s": round(wall, 3), "completion_tok_s": summary["totals"]["completion_tokens_per_second"],
                "in_engine_steps_s": steps["in_steps_s"], "outside_steps_s": round(wall - steps["in_steps_s"], 3),
                "cpu": cpu.as_dict(), "steps": steps})
    engine = min(run["wall_s"] for run in engine_runs)
    best = min(run["wall_s"] for run in flow_runs)
    engine_outside = min(run["outside_steps_s"] for run in engine_runs)
    flow_outside = min(run["outside_steps_s"] for run in flow_runs)
    result = {
        "model": args.model, "shards": args.shards, "rows": len(prompts), "max_tokens": args.max_tokens,
        "repeat": args.repeat, "engine_only_best_s": engine, "flow_best_wall_s": best,
        "overhead": round((best - engine) / engine, 3),
        # Orchestration alone: the flow's time outside engine steps beyond the baseline's,
        # over the baseline's time; machine speed swings barely touch it.
        "overhead_outside_steps": round((flow_outside - engine_outside) / engine, 3),
        # The steps themselves, slower while Prefect's threads and server share the CPUs.
        "steps_time_ratio": round(min(run["in_engine_steps_s"] for run in flow_runs)
                                  / min(run["in_engine_steps_s"] for run in engine_runs), 3),
        "engine_only_runs": engine_runs, "flow_runs": flow_runs,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
