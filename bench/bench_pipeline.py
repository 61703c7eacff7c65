"""Pipeline overhead: (flow wall time - engine-only time) / engine-only time, over 16 shards.

Engine-only: ``LLM(model)`` plus one ``generate`` over every prompt of the dataset
(after an untimed warm-up run, so first-use costs of torch count in neither).
Flow: ``batch_inference`` over the same prompts split into shards (local Parquet and
JSON Lines), under a warm Prefect API (a temporary test server, started and warmed
before timing), including listing, done checks, reads, writes, manifests, artifacts
and the engine load. Same engine options, greedy, fixed output length.

The flow runs once per ``--engine-hosts`` entry (Execution.engine_host: ``thread``,
the engine driven by a thread of the flow process; ``child``, the engine in a child
process with its own main thread), each into its own output prefix, side by side
with the same engine-only baseline, which is measured before and after the flows
(the overhead uses the faster of the two, the machine's best).

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
        from shardline.engine.tiny import build_tiny_model

        return str(build_tiny_model(root / "tiny"))
    from common import build_bench_model

    return build_bench_model(root / "bench")


def engine_only_seconds(model: str, prompts: list[str], max_tokens: int, engine_options: dict) -> float:
    from shardline import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model, **engine_options)
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - started
    llm.close()
    return seconds


def flow_seconds(job, engine_host: str) -> tuple[float, dict]:
    from shardline.flows.batch_inference import batch_inference
    from shardline.flows.execution import Execution

    started = time.perf_counter()
    summary = batch_inference(job, Execution(engine_host=engine_host))
    return time.perf_counter() - started, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["bench", "tiny"], default="bench")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--rows", type=int, default=32, help="rows per shard")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--shards-in-flight", type=int, default=4)
    parser.add_argument("--engine-hosts", default="thread,child", help="comma-separated Execution.engine_host values")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    from prefect import flow
    from prefect.testing.utilities import prefect_test_harness

    from shardline.tasks.job import BatchJob
    from shardline.tasks.sample_data import sample_prompts, write_rows

    root = Path(tempfile.mkdtemp(prefix="shardline-bench-pipeline-"))
    model = build_model(args.model, root)
    shards = [sample_prompts(args.rows, index) for index in range(args.shards)]
    for index, rows in enumerate(shards):
        write_rows(str(root / "in" / f"part-{index:05d}.{'parquet' if index % 2 == 0 else 'jsonl'}"), rows)
    prompts = [row["prompt"] for rows in shards for row in rows]
    engine_options = {"max_num_seqs": args.max_num_seqs}

    with prefect_test_harness(server_startup_timeout=120):
        flow(lambda: None, name="warm-up")()  # the API server is up and warm before timing
        engine_only_seconds(model, prompts[: args.max_num_seqs], args.max_tokens, engine_options)  # torch warm-up
        engine_before = engine_only_seconds(model, prompts, args.max_tokens, engine_options)
        flows = {}
        for engine_host in args.engine_hosts.split(","):
            job = BatchJob(input=str(root / "in"), output=str(root / f"out-{engine_host}"), model=model,
                           sampling={"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True},
                           engine_options=engine_options, shards_in_flight=args.shards_in_flight)
            flows[engine_host] = flow_seconds(job, engine_host)
        engine_after = engine_only_seconds(model, prompts, args.max_tokens, engine_options)
    engine = min(engine_before, engine_after)
    result = {
        "model": args.model, "shards": args.shards, "rows": len(prompts), "max_tokens": args.max_tokens,
        "engine_only_s": [round(engine_before, 3), round(engine_after, 3)], "flows": {},
    }
    for engine_host, (wall, summary) in flows.items():
        assert summary["totals"]["rows"] == len(prompts) and summary["totals"]["errors"] == 0
        result["flows"][engine_host] = {
            "flow_wall_s": round(wall, 3), "overhead": round((wall - engine) / engine, 3),
            "flow_completion_tok_s": summary["totals"]["completion_tokens_per_second"],
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
