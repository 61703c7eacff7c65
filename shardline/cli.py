"""The ``shardline`` command: ``run`` a batch job, or run the ``demo``.

Both run the batch_inference Prefect flow. With no PREFECT_API_URL configured,
Prefect runs it against a temporary local API server that lives as long as the
command (Prefect's ephemeral mode); with one configured, the run shows up there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

DEMO_DIR = "shardline-demo"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline", description="Offline batch LLM inference over prompt shards.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a model over every shard under INPUT, writing to OUTPUT")
    run.add_argument("input", help="prefix or glob of Parquet / JSON Lines shards (any fsspec URL)")
    run.add_argument("output", help="prefix for <shard>.parquet outputs and _manifests/")
    run.add_argument("--model", required=True, help="Hugging Face hub id or local model directory")
    run.add_argument("--revision", help="model revision")
    run.add_argument("--task", choices=["generate", "chat", "embed"], default="generate")
    run.add_argument("--input-format", choices=["auto", "parquet", "jsonl"], default="auto")
    run.add_argument("--max-tokens", type=int, default=256)
    run.add_argument("--temperature", type=float, default=1.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--seed", type=int)
    run.add_argument("-n", "--n", type=int, default=1, help="completions per row")
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--pass-through", action="append", default=[], metavar="COLUMN",
                     help="input column to copy to the output (repeatable)")
    run.add_argument("--engine-options", type=_json_object, default={}, metavar="JSON",
                     help='engine options as JSON, e.g. \'{"max_num_seqs": 64, "dtype": "bfloat16"}\'')
    run.add_argument("--storage-options", type=_json_object, default={}, metavar="JSON",
                     help="fsspec storage options as JSON (prefer AWS_* environment variables for credentials)")
    run.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="LoRA adapter (repeatable)")
    run.add_argument("--shards-in-flight", type=int, default=4)

    demo = commands.add_parser("demo", help="write a sample dataset and a tiny model, then run the flow on them")
    demo.add_argument("dir", nargs="?", default=DEMO_DIR, help=f"where to put everything (default ./{DEMO_DIR})")
    demo.add_argument("--shards", type=int, default=6)
    demo.add_argument("--rows", type=int, default=8, help="rows per shard")
    demo.add_argument("--max-tokens", type=int, default=16)
    return parser


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg}); expected an object like '{{\"key\": 1}}'")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _lora_adapters(specs: list[str]) -> dict[str, str]:
    adapters = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora expects NAME=PATH, got {spec!r}")
        adapters[name] = path
    return adapters


def job_from_args(args: argparse.Namespace) -> Any:
    """The BatchJob a ``shardline run`` command line describes."""
    from shardline.tasks.job import BatchJob

    return BatchJob(
        input=args.input, output=args.output, model=args.model, revision=args.revision, task=args.task,
        input_format=args.input_format,
        sampling={"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                  "top_k": args.top_k, "seed": args.seed, "n": args.n, "stop": args.stop},
        engine_options=args.engine_options, storage_options=args.storage_options,
        pass_through=args.pass_through, lora_adapters=_lora_adapters(args.lora),
        shards_in_flight=args.shards_in_flight,
    )


def run_job(job: Any) -> tuple[int, dict[str, Any] | None]:
    """Run the flow; (exit code, summary). Exit 1 when shards failed, 2 when the job could not start."""
    from shardline.flows.batch_inference import batch_inference
    from shardline.tasks.summary import ShardsFailed

    state = batch_inference(job, return_state=True)
    outcome = state.result(raise_on_failure=False)
    if isinstance(outcome, ShardsFailed):
        return 1, outcome.summary
    if isinstance(outcome, BaseException):
        print(f"shardline: the job failed: {type(outcome).__name__}: {outcome}", file=sys.stderr)
        return 2, None
    return 0, outcome


def cmd_run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from shardline.tasks.summary import summary_table

    try:
        job = job_from_args(args)
    except (ValidationError, ValueError) as exc:
        print(f"shardline run: invalid job: {exc}", file=sys.stderr)
        return 2
    code, summary = run_job(job)
    if summary is not None:
        print(summary_table(summary))
    return code


def cmd_demo(args: argparse.Namespace) -> int:
    from shardline.tasks.job import BatchJob
    from shardline.tasks.sample_data import write_sample_dataset
    from shardline.tasks.summary import summary_table

    root = Path(args.dir).resolve()
    started = time.perf_counter()
    print(f"[1/3] writing {args.shards} sample shards (Parquet and JSON Lines, a few bad rows) to {root}/input")
    write_sample_dataset(str(root / "input"), num_shards=args.shards, rows_per_shard=args.rows)
    model_dir = root / "tiny-model"
    print(f"[2/3] building a tiny random-weight model in {model_dir} (no download)")
    if not (model_dir / "config.json").exists():
        from shardline.engine.tiny import build_tiny_model

        build_tiny_model(model_dir, arch="llama")
    print("[3/3] running the batch-inference flow")
    job = BatchJob(input=str(root / "input"), output=str(root / "output"), model=str(model_dir),
                   sampling={"max_tokens": args.max_tokens, "temperature": 0.8, "seed": 0},
                   engine_options={"max_num_seqs": 64}, pass_through=["topic"], shards_in_flight=3)
    code, summary = run_job(job)
    if summary is None:
        return code
    print()
    print(summary_table(summary))
    _print_sample(root / "output")
    print(f"\noutputs: {root}/output/<shard>.parquet, manifests: {root}/output/_manifests/ "
          f"({time.perf_counter() - started:.1f}s). Run it again: every shard is skipped (resume).")
    return code


def _print_sample(output_dir: Path) -> None:
    import pyarrow.parquet as pq

    first = sorted(output_dir.glob("*.parquet"))[:1]
    if not first:
        return
    print(f"\nfirst rows of {first[0]}:")
    for row in pq.read_table(first[0]).slice(0, 5).to_pylist():
        shown = {k: row[k] for k in ("id", "text", "finish_reason", "completion_tokens", "error")}
        print("  " + json.dumps(shown, ensure_ascii=False))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Prefect's anonymous usage report needs the internet; a batch job should not try.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if args.command == "run":
        return cmd_run(args)
    return cmd_demo(args)


if __name__ == "__main__":
    sys.exit(main())
