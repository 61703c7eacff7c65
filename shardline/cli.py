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

from shardline.cli_args import DEBUG_ENV, build_parser, flag_of, job_from_args

SHUTDOWN_TIMEOUT_ENV = "SHARDLINE_SHUTDOWN_TIMEOUT"
EXIT_SHARDS_FAILED, EXIT_JOB_FAILED = 1, 2
EXIT_REFUSED = 1  # ``check``: the engine refuses the model


class Interrupted(BaseException):
    """SIGTERM or SIGINT reached ``shardline``; ``signum`` says which (exit code 128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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
        for line in field_errors(exc, flag_of):
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
    # Prefect's temporary API server gets 20 s to start by default; a worker busy with
    # other jobs can take longer, and a slow start is not a reason to fail the run.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
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
