"""The ``shardline`` command: ``run`` a batch job, ``check`` whether a model can run,
ask the ``status`` of a job's output, or run the ``demo``.

``check MODEL`` prints the engine's verdict (engine/model/support.py) from the
model's config alone: ``supported: ...`` (exit 0) or ``refused: ...`` and why (exit 1).
``run`` and ``demo`` run the batch_inference Prefect flow. With no PREFECT_API_URL
configured, Prefect runs it against a temporary local API server that lives as long
as the command (Prefect's ephemeral mode); with one configured, the run shows up there.

``run`` checks the job first (its fields, the model, the input, the output) and
stops in seconds with one line per problem. Expected errors print one line and
no traceback; ``--debug`` (or SHARDLINE_DEBUG=1) shows tracebacks. SIGTERM or
SIGINT stops the run cleanly (engine work aborted, nothing partial committed,
every child process stopped). Exit codes: 0 done, 1 some shards failed, 2 the
job could not run (invalid, or a pre-flight check failed), 130 / 143 stopped by
SIGINT / SIGTERM (a rerun resumes).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

DEMO_DIR = "shardline-demo"
DEBUG_ENV = "SHARDLINE_DEBUG"
SHUTDOWN_TIMEOUT_ENV = "SHARDLINE_SHUTDOWN_TIMEOUT"
EXIT_SHARDS_FAILED, EXIT_JOB_FAILED = 1, 2
EXIT_REFUSED = 1  # ``check``: the engine refuses the model
# How ``run``'s flags name the BatchJob fields (for one-line field errors).
_FLAGS = {"input": "INPUT", "output": "OUTPUT", "model": "--model", "revision": "--revision", "task": "--task",
          "input_format": "--input-format", "output_format": "--output-format",
          "served_model_name": "--served-model-name", "engine_options": "--engine-options",
          "pass_through": "--pass-through",
          "storage_options": "--storage-options", "lora_adapters": "--lora", "shards_in_flight": "--shards-in-flight",
          "data_parallel_size": "--data-parallel-size", "tensor_parallel_size": "--tensor-parallel-size",
          "sampling.max_tokens": "--max-tokens", "sampling.temperature": "--temperature", "sampling.top_p": "--top-p",
          "sampling.top_k": "--top-k", "sampling.seed": "--seed", "sampling.n": "--n", "sampling.stop": "--stop",
          "structured_outputs": "--json-schema/--choice/--regex/--grammar", "reasoning_parser": "--reasoning-parser",
          "quantization": "--quantization", "tool_call_parser": "--tool-call-parser",
          "sampling.max_reasoning_tokens": "--max-reasoning-tokens", "images.column": "--image-column",
          "images.allowed_domains": "--allowed-media-domain", "images.max_image_bytes": "--max-image-bytes",
          "images.prefetch_bytes": "--image-prefetch-bytes"}
# The flags that set the job's structured_outputs, and the field each sets.
_CONSTRAINT_FLAGS = {"json_schema": "--json-schema", "choice": "--choice", "regex": "--regex", "grammar": "--grammar"}


class Interrupted(BaseException):
    """SIGTERM or SIGINT reached ``shardline``; ``signum`` says which (exit code 128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline", description="Offline batch LLM inference over prompt shards.")
    parser.add_argument("--debug", action="store_true", help=f"show tracebacks of errors (or set {DEBUG_ENV}=1)")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a model over every shard under INPUT, writing to OUTPUT")
    run.add_argument("input", help="prefix or glob of Parquet / JSON Lines shards (any fsspec URL)")
    run.add_argument("output", help="prefix for <shard>.parquet outputs and _manifests/")
    run.add_argument("--model", required=True, help="Hugging Face hub id or local model directory")
    run.add_argument("--revision", help="model revision")
    run.add_argument("--task", choices=["generate", "chat", "embed"], default="generate")
    run.add_argument("--input-format", choices=["auto", "parquet", "jsonl", "openai"], default="auto",
                     help="auto: by extension, and JSON Lines of OpenAI Batch requests as openai")
    run.add_argument("--output-format", choices=["parquet", "openai"], default="parquet",
                     help="openai: OpenAI Batch output lines in <shard>.jsonl and <shard>.errors.jsonl")
    run.add_argument("--served-model-name", help="the model name OpenAI Batch requests may give, and "
                     "responses carry (default: --model)")
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
    run.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                     help="engine replicas on this worker, each in its own process on its own GPU(s) (on CPU, a "
                          "share of the cores), fed from one queue of rows")
    run.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                     help="GPUs the model is split over (one process per rank, started by the engine), for a "
                          "model larger than one GPU")
    run.add_argument("--quantization", metavar="NAME", help="fp8 or int8: quantize a 16/32-bit checkpoint's "
                     "linears at load; or a quantized checkpoint's own format (its quant_method)")
    run.add_argument("--progress-interval", type=_positive_seconds, default=30.0, metavar="SECONDS",
                     help="seconds between progress lines (rows, tokens/s, ETA, engine health) when stderr is not "
                          "a terminal; a terminal gets a progress bar")
    structured = run.add_argument_group(
        "structured outputs and reasoning", "constrain every output to one of these (rows may override it with a "
        "response_format or json_schema column); JSON outputs are validated into the `parsed` column")
    structured.add_argument("--json-schema", metavar="FILE", help="a JSON Schema file")
    structured.add_argument("--choice", action="append", metavar="TEXT", help="an allowed output (repeatable)")
    structured.add_argument("--regex", help="a regular expression every output matches in full")
    structured.add_argument("--grammar", metavar="FILE", help="an EBNF grammar file (xgrammar's dialect, rule root)")
    structured.add_argument("--compact-json", action="store_true", help="no whitespace between JSON tokens")
    structured.add_argument("--reasoning-parser", metavar="NAME",
                            help="qwen3, deepseek_r1 or openai_gptoss: put the model's thinking in a "
                                 "`reasoning` column")
    structured.add_argument("--max-reasoning-tokens", type=int, metavar="N", help="most thinking tokens per row")
    structured.add_argument("--tool-call-parser", metavar="NAME",
                            help="hermes, llama3_json, mistral, deepseek_v3, deepseek_v31, openai, qwen3_coder or "
                                 "qwen3_xml: read the tool calls of requests and chat rows that offer tools "
                                 "(default: the one the chat template implies)")
    images = run.add_argument_group("images", "rows with images: an image column, or image_url parts in messages")
    images.add_argument("--image-column", metavar="COLUMN", help="the column of each row's image(s): encoded bytes, "
                        "a URL (data:, s3://, file://, ...) or a list of them")
    images.add_argument("--allowed-media-domain", action="append", default=[], metavar="HOST",
                        help="a host http(s) image URLs may name, with its subdomains (repeatable; none: refused)")
    images.add_argument("--max-image-bytes", type=int, metavar="N", help="largest encoded image read (default 20 MiB)")
    images.add_argument("--image-prefetch-bytes", type=int, metavar="N",
                        help="most decoded image bytes held ahead of the engine per shard (default 512 MiB)")

    check = commands.add_parser("check", help="say whether shardline can run MODEL, and if not why (reads its config "
                                "and builds it on the meta device: no weights)")
    check.add_argument("model", help="Hugging Face hub id or local model directory")
    check.add_argument("--task", choices=["generate", "embed"], default="generate")
    check.add_argument("--revision", help="model revision")
    check.add_argument("--trust-remote-code", action="store_true", help="let the config's auto_map name its classes")
    check.add_argument("--quantization", metavar="NAME", help="the engine's quantization option (fp8, int8, ...)")

    status = commands.add_parser("status", help="how far the job writing OUTPUT got: each shard done, failed or "
                                 "missing, with rows, errors, tokens and time from its manifest; totals")
    status.add_argument("output", help="the job's output prefix (any fsspec URL)")
    status.add_argument("--storage-options", type=_json_object, default={}, metavar="JSON",
                        help="fsspec storage options as JSON, as given to run")
    status.add_argument("--json", action="store_true", help="print the status as one JSON object")

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
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({exc.msg}); expected an object like '{{\"key\": 1}}'") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return seconds


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

    # Validated from plain values, so a bad value's error names its field's path
    # (sampling.max_tokens), which _flag turns into the flag that set it.
    return BatchJob.model_validate(dict(
        input=args.input, output=args.output, model=args.model, revision=args.revision, task=args.task,
        input_format=args.input_format, output_format=args.output_format, served_model_name=args.served_model_name,
        sampling={"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                  "top_k": args.top_k, "seed": args.seed, "n": args.n, "stop": args.stop,
                  "max_reasoning_tokens": args.max_reasoning_tokens},
        structured_outputs=_structured_outputs(args), reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        engine_options=args.engine_options, storage_options=args.storage_options,
        pass_through=args.pass_through, lora_adapters=_lora_adapters(args.lora),
        shards_in_flight=args.shards_in_flight, quantization=args.quantization, images=_image_options(args),
        data_parallel_size=args.data_parallel_size, tensor_parallel_size=args.tensor_parallel_size,
    ))


def _image_options(args: argparse.Namespace) -> dict[str, Any]:
    """The job's images options from the --image-column group (unset flags keep the defaults)."""
    options = {"column": args.image_column, "allowed_domains": args.allowed_media_domain,
               "max_image_bytes": args.max_image_bytes, "prefetch_bytes": args.image_prefetch_bytes}
    return {name: value for name, value in options.items() if value is not None}


def _structured_outputs(args: argparse.Namespace) -> dict[str, Any] | None:
    """The job's structured_outputs from --json-schema, --choice, --regex or --grammar (at most one)."""
    given = {field: getattr(args, field) for field in _CONSTRAINT_FLAGS if getattr(args, field) is not None}
    if len(given) > 1:
        raise ValueError(f"{' and '.join(_CONSTRAINT_FLAGS[field] for field in given)} cannot be combined: "
                         "give one constraint")
    if not given:
        if args.compact_json:
            raise ValueError("--compact-json needs --json-schema")
        return None
    (field, value), = given.items()
    if field in ("json_schema", "grammar"):
        try:
            value = Path(value).read_text()
        except OSError as exc:
            raise ValueError(f"{_CONSTRAINT_FLAGS[field]}: cannot read {value}: {exc.strerror or exc}") from None
    return {field: value, "disable_any_whitespace": args.compact_json}


def _flag(loc: tuple[Any, ...]) -> str:
    """The command-line name of a BatchJob field (``sampling.max_tokens`` -> ``--max-tokens``)."""
    dotted = ".".join(str(part) for part in loc)
    if dotted in _FLAGS:
        return _FLAGS[dotted]
    top = str(loc[0]) if loc else ""
    return f"{_FLAGS[top]} ({dotted})" if top in _FLAGS else dotted or "the job"


def run_job(job: Any, progress_interval: float = 30.0) -> tuple[int, dict[str, Any] | None]:
    """Run the flow; (exit code, summary). Exit 1 when shards failed, 2 when the job could not run."""
    from shardline.flows.batch_inference import batch_inference
    from shardline.tasks.summary import ShardsFailed

    if not _debug():
        _quiet_console_tracebacks()
    state = batch_inference(job, progress_interval=progress_interval, return_state=True)
    outcome = state.result(raise_on_failure=False)
    if isinstance(outcome, ShardsFailed):
        return EXIT_SHARDS_FAILED, outcome.summary
    if isinstance(outcome, BaseException):
        _report(outcome, "the job failed")
        return EXIT_JOB_FAILED, None
    return 0, outcome


def cmd_run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from shardline.tasks.errors import PipelineError
    from shardline.tasks.preflight import field_errors, preflight
    from shardline.tasks.summary import summary_table

    try:
        job = job_from_args(args)
    except ValidationError as exc:
        for line in field_errors(exc, _flag):
            print(f"shardline run: {line}", file=sys.stderr)
        return EXIT_JOB_FAILED
    except ValueError as exc:
        print(f"shardline run: {exc}", file=sys.stderr)
        return EXIT_JOB_FAILED
    try:
        preflight(job)  # in seconds, before Prefect starts; the flow checks again (UI runs)
    except PipelineError as exc:
        _report(exc, "pre-flight check failed")
        return EXIT_JOB_FAILED
    code, summary = run_job(job, args.progress_interval)
    if summary is not None:
        print(summary_table(summary))
    return code


def cmd_status(args: argparse.Namespace) -> int:
    """Print the output's status (tasks/status.py); exit 2 when it cannot be read."""
    from shardline.tasks.errors import PipelineError
    from shardline.tasks.status import output_status, status_table

    try:
        status = output_status(args.output, args.storage_options)
    except PipelineError as exc:
        _report(exc, "status")
        return EXIT_JOB_FAILED
    print(json.dumps(status.as_json(), indent=2) if args.json else status_table(status))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Print the engine's verdict on the model: ``supported: ...`` (exit 0) or
    ``refused: ...`` with the reason (exit 1); exit 2 when its config cannot be read."""
    from shardline.tasks.errors import PipelineError
    from shardline.tasks.job import JobTask
    from shardline.tasks.preflight import model_verdict

    try:
        support = model_verdict(args.model, JobTask(args.task), args.revision, args.trust_remote_code,
                                args.quantization)
    except PipelineError as exc:
        _report(exc, "check failed")
        return EXIT_JOB_FAILED
    print(f"{'supported' if support.ok else 'refused'}: {support.message}")
    return 0 if support.ok else EXIT_REFUSED


def _report(exc: BaseException, what: str) -> None:
    """One line per error (a pre-flight failure may hold several); the traceback only in debug mode."""
    from shardline.tasks.errors import PipelineError, describe

    lines = str(exc).splitlines() if isinstance(exc, PipelineError) else [describe(exc)]
    for line in lines or [type(exc).__name__]:
        print(f"shardline: {what}: {line}", file=sys.stderr)
    if _debug():
        traceback.print_exception(exc, file=sys.stderr)


class _NoTraceback(logging.Filter):
    """Drops a record's traceback (the one-line message stays): what console handlers show
    unless in debug mode. Prefect's API handler keeps it, so the UI still has it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def _quiet_console_tracebacks() -> None:
    """Keep tracebacks off the terminal: add _NoTraceback to every console log handler
    (Prefect's configured ones included, which is why prefect is imported first)."""
    import prefect  # noqa: F401  (configures Prefect's log handlers)

    loggers = [logging.getLogger()] + [logger for logger in logging.root.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler).__name__ != "APILogHandler" and isinstance(handler, logging.StreamHandler) \
                    and not any(isinstance(f, _NoTraceback) for f in handler.filters):
                handler.addFilter(_NoTraceback())


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false", "no")


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
        from shardline.engine.model.tiny import build_tiny_model

        build_tiny_model(model_dir, arch="llama")
    print("[3/3] running the batch-inference flow")
    job = BatchJob.model_validate(dict(
        input=str(root / "input"), output=str(root / "output"), model=str(model_dir),
        sampling={"max_tokens": args.max_tokens, "temperature": 0.8, "seed": 0},
        engine_options={"max_num_seqs": 64}, pass_through=["topic"], shards_in_flight=3))
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
    debug_before = os.environ.get(DEBUG_ENV)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # for this command (and its children) only: restored below
    # Prefect's anonymous usage report needs the internet; a batch job should not try.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    previous = _handle_signals()
    try:
        return {"run": cmd_run, "check": cmd_check, "status": cmd_status, "demo": cmd_demo}[args.command](args)
    except Interrupted as stop:
        print(f"shardline: stopped by {stop}: running requests aborted, nothing partial written; "
              "shards already committed are kept and rerunning the same command resumes", file=sys.stderr)
        return 128 + stop.signum
    except Exception as exc:  # not an expected error: one line, the traceback with --debug
        _report(exc, "internal error (rerun with --debug for the traceback)")
        return EXIT_JOB_FAILED
    finally:
        _restore_signals(previous)
        if debug_before is None:
            os.environ.pop(DEBUG_ENV, None)
        else:
            os.environ[DEBUG_ENV] = debug_before


def _handle_signals() -> dict[int, Any]:
    """SIGTERM and SIGINT stop the run cleanly (see _on_signal); returns the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, _on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}


def _restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _on_signal(signum: int, frame: Any) -> None:
    """First signal: abort all engine work and stop the run (raise Interrupted in the main
    thread, where the flow or its start-up is waiting), with a watchdog that ends every
    child process and exits if the orderly stop overruns. A second signal exits now.

    While a flow runs, Prefect's own SIGTERM handler raises its TerminationSignal in
    the flow first (the flow then aborts its shards) and passes the signal on here."""
    from shardline.tasks.engine_cache import request_shutdown
    from shardline.tasks.shutdown import shutdown_reason

    name = signal.Signals(signum).name
    if shutdown_reason() is not None and _STOPPING.is_set():
        _exit_now(signum)
    _STOPPING.set()
    request_shutdown(name)
    threading.Thread(target=_watchdog, args=(signum,), name="shardline-shutdown-watchdog", daemon=True).start()
    raise Interrupted(signum)


_STOPPING = threading.Event()  # set by the first signal; a second one exits at once


def _watchdog(signum: int) -> None:
    try:
        timeout = float(os.environ.get(SHUTDOWN_TIMEOUT_ENV, "20"))
    except ValueError:
        timeout = 20.0
    time.sleep(timeout)
    print(f"shardline: the orderly stop took over {timeout:.0f}s ({SHUTDOWN_TIMEOUT_ENV}); exiting now",
          file=sys.stderr)
    _exit_now(signum)


def _exit_now(signum: int) -> None:
    """End every child process (Prefect's server, an engine child) and exit without cleanup."""
    from shardline.tasks.process_tree import terminate_descendants

    terminate_descendants(os.getpid())
    logging.shutdown()
    os._exit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
