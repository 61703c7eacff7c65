"""A job's progress by rows and tokens, within and across shards, for whoever watches it.

``JobProgress`` counts what the shards of one run report: a shard's rows once it is
read (so a JSON Lines shard, whose length nobody knows in advance, counts as it is
read), each row as the engine finishes it, and each shard as its task ends. Sinks
(a log line, a terminal bar, a Prefect artifact: tasks/progress_report.py,
flows/artifacts.py) get a ``ProgressSnapshot`` at most once per their own interval.

Updates are driven by rows: every report checks whether a sink is due, so a long
shard updates its watchers while it runs and a test drives them without sleeping
(the clock is injectable). ``heartbeat()`` adds a thread that polls on time too, so
a line still comes when no row finishes (a starved or stuck engine).

Invariants:
- A shard's row counts are its own until the shard ends: a shard read again (a task
  retry) starts from zero, and a failed shard's rows leave the totals.
- Rows of shards skipped as already done are not counted (the rate and ETA are this
  run's); those shards count as finished.
- Reports come from any thread (the engine's driver included) and never raise into
  it: a sink that fails is logged and the job goes on.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .executor import EngineReading, RowDone
from .manifest import ShardManifest
from .storage import Shard

logger = logging.getLogger("shardline.tasks.progress")

Sink = Callable[["ProgressSnapshot"], None]
HEARTBEAT_MIN_SECONDS = 0.1
Clock = Callable[[], float]


@dataclass(frozen=True)
class EngineHealth:
    """The engine's load at a snapshot: requests running and waiting, KV-cache use,
    prefix-cache hit rate, preemptions so far, and the share of the time since the last
    snapshot that the engine waited for rows with nothing to run (high: the readers,
    not the engine, set the pace)."""

    running: int
    waiting: int
    kv_cache_usage: float | None
    prefix_cache_hit_rate: float | None
    preemptions: int
    starved_share: float | None


@dataclass(frozen=True)
class ProgressSnapshot:
    """A run's progress at one moment. ``rows_known`` counts the rows of the shards read
    so far; ``rows_expected`` adds an estimate for the shards not yet read, by their
    size in bytes (None until a shard with a size has been read). Rates and the ETA count
    from the first row the engine finished (so the model's load is not in them), or from
    the run's start when no row reports come (shards on other processes)."""

    elapsed_seconds: float
    shards_total: int
    shards_finished: int  # done, skipped or failed
    shards_failed: int
    shards_unread: int
    rows_done: int
    rows_known: int
    rows_expected: int | None
    errors: int
    completion_tokens: int
    rows_per_second: float
    tokens_per_second: float
    eta_seconds: float | None
    engine: EngineHealth | None = None

    @property
    def fraction(self) -> float | None:
        """Rows done of rows expected (0 to 1), None while nothing is known."""
        if self.rows_expected is None:
            return 1.0 if self.shards_total == self.shards_finished else None
        return min(1.0, self.rows_done / self.rows_expected) if self.rows_expected else 1.0


@dataclass
class _ShardCount:
    size: int  # bytes, from the listing
    rows: int | None = None  # None until read
    rows_done: int = 0
    errors: int = 0
    completion_tokens: int = 0


@dataclass
class _SinkEntry:
    sink: Sink
    every_seconds: float
    next_due: float


class JobProgress:
    """Counts one run's rows, errors and tokens across its shards; feeds the sinks."""

    def __init__(self, shards: Sequence[Shard], shards_done_before: int = 0, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.RLock()
        self._started = clock()
        self._shards = {shard.key: _ShardCount(shard.size) for shard in shards}
        self._total = len(self._shards) + shards_done_before
        self._finished, self._failed = shards_done_before, 0
        self._ended = _ShardCount(0, rows=0)  # the counts of shards that ended, summed
        self._ended_bytes = 0
        self._sinks: list[_SinkEntry] = []
        self._engine_source: Callable[[], EngineReading | None] | None = None
        self._last_reading: EngineReading | None = None
        self._next_due = float("inf")
        self._first_row: tuple[float, int, int] | None = None  # (time, rows done, tokens) at the first row

    # ------------------------------------------------------------------ reports
    def add_sink(self, sink: Sink, every_seconds: float) -> None:
        """Give ``sink`` a snapshot at most every ``every_seconds`` (0: at every report)."""
        if every_seconds < 0:
            raise ValueError(f"a progress interval is 0 or more seconds, got {every_seconds}")
        with self._lock:
            self._sinks.append(_SinkEntry(sink, every_seconds, self._clock() + every_seconds))
            self._next_due = min(entry.next_due for entry in self._sinks)

    def watch_engine(self, source: Callable[[], EngineReading | None]) -> None:
        """Read the engine's load from ``source`` (an executor's engine_reading) at each snapshot."""
        self._engine_source = source

    def shard_read(self, key: str, rows: int, errors: int = 0) -> None:
        """Shard ``key`` holds ``rows`` rows, ``errors`` of them refused before the engine
        (they count as done). A shard read again starts its counts afresh."""
        with self._lock:
            count = self._shards.setdefault(key, _ShardCount(0))
            count.rows, count.rows_done, count.errors, count.completion_tokens = rows, errors, errors, 0
        self.poll()

    def row_done(self, key: str, done: RowDone) -> None:
        """One row of shard ``key`` came back from the engine."""
        with self._lock:
            if self._first_row is None:  # rates count from here: the engine's load is not theirs
                self._first_row = (self._clock(), *self._done_so_far())
            count = self._shards.get(key)
            if count is not None:
                count.rows_done += 1
                count.errors += done.failed
                count.completion_tokens += done.completion_tokens
        if self._clock() >= self._next_due:
            self.poll()

    def on_row(self, key: str) -> Callable[[RowDone], None]:
        """The ShardExecutor's ``on_row`` for shard ``key``."""
        return lambda done: self.row_done(key, done)

    def was_read(self, key: str) -> bool:
        """Whether shard ``key`` was read in this run and has not ended (else it was skipped)."""
        with self._lock:
            count = self._shards.get(key)
            return count is not None and count.rows is not None

    def shard_finished(self, key: str, manifest: ShardManifest | None, ran: bool = True) -> None:
        """Shard ``key`` ended: committed (``manifest``; ``ran`` False when it was skipped as
        already done) or failed (None)."""
        with self._lock:
            count = self._shards.pop(key, None)
            self._finished += 1
            if manifest is None:
                self._failed += 1
            elif ran:  # the manifest's counts are the truth
                self._ended.rows = (self._ended.rows or 0) + manifest.rows
                self._ended.rows_done += manifest.rows
                self._ended.errors += manifest.errors
                self._ended.completion_tokens += manifest.completion_tokens
                self._ended_bytes += count.size if count is not None else 0
        self.poll()

    def _done_so_far(self) -> tuple[int, int]:
        """(rows done, output tokens) of the run so far; the lock is held."""
        counts = [self._ended, *self._shards.values()]
        return sum(count.rows_done for count in counts), sum(count.completion_tokens for count in counts)

    # ---------------------------------------------------------------- snapshots
    def poll(self) -> None:
        """Give every due sink a snapshot (called by reports and the heartbeat)."""
        now = self._clock()
        with self._lock:
            due = [entry for entry in self._sinks if now >= entry.next_due]
            if not due:
                return
            for entry in due:
                entry.next_due = now + entry.every_seconds
            self._next_due = min(entry.next_due for entry in self._sinks)
        self._emit(self.snapshot(), [entry.sink for entry in due])

    def finish(self) -> ProgressSnapshot:
        """Give every sink the final snapshot; return it."""
        snapshot = self.snapshot()
        self._emit(snapshot, [entry.sink for entry in self._sinks])
        return snapshot

    @contextlib.contextmanager
    def heartbeat(self, every_seconds: float) -> Iterator[None]:
        """Poll every ``every_seconds`` (at least HEARTBEAT_MIN_SECONDS) from a thread of its own
        while the block runs, then finish."""
        stop = threading.Event()
        every_seconds = max(every_seconds, HEARTBEAT_MIN_SECONDS)

        def beat() -> None:
            while not stop.wait(every_seconds):
                self.poll()

        thread = threading.Thread(target=beat, name="shardline-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.finish()

    def snapshot(self) -> ProgressSnapshot:
        """The counts now, with rates, an ETA and the engine's health."""
        now = self._clock()
        with self._lock:
            running = list(self._shards.values())
            ended, ended_bytes = self._ended, self._ended_bytes
            shards = (self._total, self._finished, self._failed)
        read = [count for count in running if count.rows is not None]
        rows_known = (ended.rows or 0) + sum(count.rows or 0 for count in read)
        rows_done = ended.rows_done + sum(count.rows_done for count in read)
        tokens = ended.completion_tokens + sum(count.completion_tokens for count in read)
        unread = [count for count in running if count.rows is None]
        read_bytes = ended_bytes + sum(count.size for count in read)
        expected: int | None = rows_known
        if unread:  # the rows per byte of the shards read so far, over the bytes not read yet
            expected = rows_known + round(rows_known / read_bytes * sum(count.size for count in unread)) \
                if read_bytes and rows_known else None
        since, rows_before, tokens_before = self._first_row or (self._started, 0, 0)
        elapsed = max(now - since, 1e-9)
        rows_rate, tokens_rate = max(rows_done - rows_before, 0) / elapsed, max(tokens - tokens_before, 0) / elapsed
        eta = (expected - rows_done) / rows_rate if expected is not None and rows_rate > 0 else None
        return ProgressSnapshot(
            elapsed_seconds=now - self._started, shards_total=shards[0], shards_finished=shards[1],
            shards_failed=shards[2], shards_unread=len(unread), rows_done=rows_done, rows_known=rows_known,
            rows_expected=expected, errors=ended.errors + sum(count.errors for count in read),
            completion_tokens=tokens, rows_per_second=rows_rate, tokens_per_second=tokens_rate,
            eta_seconds=None if eta is None else max(eta, 0.0), engine=self._engine_health())

    def _engine_health(self) -> EngineHealth | None:
        if self._engine_source is None:
            return None
        try:
            reading = self._engine_source()
        except Exception:  # a service that went away: the line goes on without it
            logger.debug("reading the engine's load failed", exc_info=True)
            return None
        if reading is None:
            return None
        last, self._last_reading = self._last_reading, reading
        starved = None
        if last is not None and reading.at > last.at:
            starved = min(1.0, max(0.0, (reading.idle_seconds - last.idle_seconds) / (reading.at - last.at)))
        stats = reading.stats
        return EngineHealth(stats.num_running, stats.num_waiting, stats.kv_cache_usage, stats.prefix_cache_hit_rate,
                            stats.num_preemptions, starved)

    def _emit(self, snapshot: ProgressSnapshot, sinks: list[Sink]) -> None:
        for sink in sinks:
            try:
                sink(snapshot)
            except Exception:  # a watcher's failure (an API down) never stops the job
                logger.warning("a progress report failed", exc_info=True)


class ThroughputLog:
    """Rows done and output tokens over a run, one point per call: a JobProgress sink whose
    ``spans`` give the summary's throughput chart."""

    def __init__(self) -> None:
        self.points: list[tuple[float, int, int]] = [(0.0, 0, 0)]  # (elapsed s, rows done, output tokens)

    def __call__(self, snapshot: ProgressSnapshot) -> None:
        self.points.append((snapshot.elapsed_seconds, snapshot.rows_done, snapshot.completion_tokens))

    def spans(self, count: int = 12) -> list[dict[str, float]]:
        """Rows/s and output tokens/s over ``count`` equal spans of the run (fewer for a
        short one), counts read between points on a straight line."""
        end = self.points[-1][0]
        if end <= 0:
            return []
        count = max(1, min(count, len(self.points) - 1))
        edges = [end * i / count for i in range(count + 1)]
        at = [self._at(edge) for edge in edges]
        return [{"from_seconds": round(edges[i], 3), "to_seconds": round(edges[i + 1], 3),
                 "rows_per_second": round(max(0.0, at[i + 1][0] - at[i][0]) / (edges[i + 1] - edges[i]), 3),
                 "tokens_per_second": round(max(0.0, at[i + 1][1] - at[i][1]) / (edges[i + 1] - edges[i]), 3)}
                for i in range(count)]

    def _at(self, elapsed: float) -> tuple[float, float]:
        """(rows done, output tokens) at ``elapsed`` seconds, between the points around it."""
        times = [point[0] for point in self.points]
        right = min(bisect.bisect_left(times, elapsed), len(self.points) - 1)
        left = max(right - 1, 0)
        (t0, r0, k0), (t1, r1, k1) = self.points[left], self.points[right]
        share = 0.0 if t1 <= t0 else min(1.0, max(0.0, (elapsed - t0) / (t1 - t0)))
        return r0 + (r1 - r0) * share, k0 + (k1 - k0) * share
