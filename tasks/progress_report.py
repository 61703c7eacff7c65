"""How a job's progress is shown: one line of text, a log sink, a terminal bar.

The same ``ProgressSnapshot`` (tasks/progress.py) feeds each of them: the CLI shows a
bar when stderr is a terminal and a log line every interval otherwise, the Prefect
flow logs the line and updates its progress artifact (flows/artifacts.py), and the
Airflow operator writes the line to its task log.
"""

from __future__ import annotations

import logging
from typing import IO, Any

from tqdm.auto import tqdm

from .progress import EngineHealth, JobProgress, ProgressSnapshot, Sink

DEFAULT_INTERVAL_SECONDS = 30.0  # between log lines when nobody watches a terminal
BAR_INTERVAL_SECONDS = 0.5  # between redraws of a terminal bar


def progress_line(snapshot: ProgressSnapshot) -> str:
    """The snapshot as one line: rows, errors, shards, speeds, ETA, and the engine's health."""
    parts = [f"rows {_rows(snapshot)}", f"{snapshot.errors:,} error(s)",
             f"shards {snapshot.shards_finished} of {snapshot.shards_total} finished"
             + (f" ({snapshot.shards_failed} failed)" if snapshot.shards_failed else ""),
             f"{snapshot.tokens_per_second:,.1f} tok/s, {snapshot.rows_per_second:,.2f} rows/s",
             f"ETA {duration(snapshot.eta_seconds)}"]
    if snapshot.engine is not None:
        parts.append(f"engine: {engine_line(snapshot.engine)}")
    return " | ".join(parts)


def _rows(snapshot: ProgressSnapshot) -> str:
    done, known, expected = snapshot.rows_done, snapshot.rows_known, snapshot.rows_expected
    fraction = snapshot.fraction
    percent = f" ({fraction:.0%})" if fraction is not None else ""
    if snapshot.shards_unread == 0:
        return f"{done:,} of {known:,}{percent}"
    estimate = f"~{expected:,}" if expected is not None else "?"
    return f"{done:,} of {known:,} read, {estimate} expected{percent}; {snapshot.shards_unread} shard(s) not read yet"


def engine_line(health: EngineHealth) -> str:
    """The engine's health as a short phrase."""
    parts = [f"{health.running} running", f"{health.waiting} waiting"]
    if health.kv_cache_usage is not None:
        parts.append(f"KV cache {health.kv_cache_usage:.0%}")
    if health.prefix_cache_hit_rate is not None:
        parts.append(f"prefix hits {health.prefix_cache_hit_rate:.0%}")
    parts.append(f"{health.preemptions} preemption(s)")
    if health.starved_share is not None:
        parts.append(f"waiting for input {health.starved_share:.0%}")
    return ", ".join(parts)


def duration(seconds: float | None) -> str:
    """``1h02m``, ``3m05s``, ``42s``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def log_sink(log: logging.Logger | logging.LoggerAdapter[Any]) -> Sink:
    """A sink writing ``progress: <line>`` to ``log`` at INFO."""
    return lambda snapshot: log.info("progress: %s", progress_line(snapshot))


class TerminalBar:
    """A tqdm bar of rows done (of rows expected, once known) with speeds and the
    engine's health beside it; for a stream that is a terminal."""

    def __init__(self, stream: IO[str]) -> None:
        self._bar = tqdm(total=None, unit="row", desc="rows", file=stream, dynamic_ncols=True, leave=True)

    def __call__(self, snapshot: ProgressSnapshot) -> None:
        bar = self._bar
        if snapshot.rows_expected is not None and bar.total != snapshot.rows_expected:
            bar.total = snapshot.rows_expected
        bar.n = snapshot.rows_done
        postfix = [f"{snapshot.tokens_per_second:,.0f} tok/s", f"{snapshot.errors} err",
                   f"shards {snapshot.shards_finished}/{snapshot.shards_total}"]
        if snapshot.engine is not None:
            postfix.append(engine_line(snapshot.engine))
        bar.set_postfix_str(", ".join(postfix), refresh=False)
        bar.refresh()

    def close(self) -> None:
        self._bar.close()


def show_progress(progress: JobProgress, log: logging.Logger | logging.LoggerAdapter[Any], stream: IO[str],
                  interval_seconds: float = DEFAULT_INTERVAL_SECONDS) -> TerminalBar | None:
    """A bar on ``stream`` when it is a terminal, else a line to ``log`` every
    ``interval_seconds``; returns the bar (close it at the end), if any."""
    if stream.isatty():
        bar = TerminalBar(stream)
        progress.add_sink(bar, BAR_INTERVAL_SECONDS)
        return bar
    progress.add_sink(log_sink(log), interval_seconds)
    return None
