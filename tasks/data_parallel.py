"""Data parallelism on one worker: N engine replicas fed from one queue of rows.

``DataParallelRunner`` is a ShardExecutor (tasks/executor.py) over N replica processes
(tasks/replica.py, placed by tasks/replicas.py: each on its own device(s), or on CPU
with a share of the threads). Shards in flight are cut into batches of consecutive
rows, queued in the order the shards arrived; a driver thread hands the oldest batch
to the replica with the fewest rows outstanding whenever one has room, so no replica
idles while another has queued work, and the earliest shard finishes first.

Invariants:
- Only the driver thread sends batches and aborts to replicas; callers and the
  replicas' reader threads change state under ``_cond`` and wake it. ``abort_shard``
  and ``abort_all`` take only that reentrant lock (callable from a signal handler).
- A replica holds at most ``replica_rows`` rows (its engine's max_num_seqs and one
  batch more): enough to keep its batch full, little enough that a shard's last
  rows are not stuck behind another replica's queue.
- A shard's results come back by position, so its RowResults are in input order
  whatever replica ran which batch; a row is in at most one replica at a time.
- A replica that dies fails every shard with rows on it (RunnerError naming the
  replica and how it ended); their other batches are dropped or aborted, so the
  shard is retried whole as any failed shard. The others go on; the dead replica
  is started again in the background (up to ``max_restarts`` times).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from shardline.engine.config import EngineConfig
from shardline.engine.outputs import EngineStats

from .executor import EngineReading, RowCallback, RowRequest, RowResult, RunnerError, ShardAborted, report_row
from .replicas import Placement, ReplicaProcess, plan_placements

logger = logging.getLogger("shardline.tasks.data_parallel")

LOAD_SECONDS = 1800.0  # a large model can take many minutes to load
MAX_BATCH_ROWS = 32


@dataclass(eq=False)
class _Shard:
    """One shard inside the runner: its rows, results by position, a done event."""

    key: str
    rows: list[RowRequest]
    on_row: RowCallback | None
    results: dict[int, RowResult] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    failure: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        if not self.done.is_set():
            self.failure = exc
            self.done.set()


@dataclass(eq=False)
class _Batch:
    """Consecutive rows of one shard, handed to one replica as a unit."""

    batch_id: str
    shard: _Shard
    positions: range


@dataclass
class _ReplicaState:
    """What the driver knows of one replica slot."""

    replica: ReplicaProcess | None  # None while it is (re)starting or after it died for good
    placement: Placement
    restarting: bool = False  # a restart is on its way (``starting`` once its process runs)
    starting: ReplicaProcess | None = None  # a restart still loading its engine
    batches: dict[str, _Batch] = field(default_factory=dict)  # outstanding here, by id
    rows_out: int = 0
    restarts: int = 0
    reading: EngineReading | None = None
    stats: dict[str, Any] = field(default_factory=dict)


class DataParallelRunner:
    """Runs shards over ``size`` engine replicas of ``model`` from one row queue."""

    def __init__(self, model: str, engine_options: dict[str, Any], size: int, owner_drives: bool = False,
                 max_restarts: int = 2) -> None:
        self.model, self.engine_options, self.size = model, dict(engine_options), size
        max_num_seqs = int(self.engine_options.get("max_num_seqs", EngineConfig.max_num_seqs))
        self.batch_rows = max(1, min(MAX_BATCH_ROWS, max_num_seqs // 4))
        self.replica_rows = max_num_seqs + self.batch_rows
        self._max_restarts = max_restarts
        self._cond = threading.Condition(threading.RLock())
        self._queue: collections.deque[_Batch] = collections.deque()
        self._aborts: list[tuple[ReplicaProcess, str]] = []  # batches to abort, sent by the driver
        self._report_lock = threading.Lock()  # the replicas' readers report rows one at a time
        self._active: set[_Shard] = set()
        self._ids = itertools.count(1)
        self._closed = False
        self._states = [_ReplicaState(None, placement) for placement in plan_placements(size, self.engine_options)]
        self._start_all()
        self._driven_by_owner = owner_drives
        self._thread: threading.Thread | None = None
        if not owner_drives:
            self._thread = threading.Thread(target=self._drive, name="shardline-dp-driver", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ ShardExecutor
    def run_shard(self, key: str, rows: list[RowRequest], on_row: RowCallback | None = None) -> list[RowResult]:
        """Run ``rows`` of shard ``key`` over the replicas; one RowResult each, in order."""
        if not rows:
            return []
        shard = _Shard(key, list(rows), on_row)
        with self._cond:
            if self._closed:
                raise RunnerError("the data-parallel runner is closed")
            if self._none_left():
                raise RunnerError(f"every data-parallel replica of {self.model} has died and none restarted")
            serial = next(self._ids)
            for start in range(0, len(shard.rows), self.batch_rows):
                positions = range(start, min(start + self.batch_rows, len(shard.rows)))
                self._queue.append(_Batch(f"{key}@{serial}#{start}", shard, positions))
            self._active.add(shard)
            self._cond.notify_all()
        shard.done.wait()
        with self._cond:
            self._active.discard(shard)
        if shard.failure is not None:
            raise shard.failure
        return [shard.results[position] for position in range(len(shard.rows))]

    def abort_shard(self, key: str) -> bool:
        """Abort shard ``key``: its queued batches are dropped, those on replicas aborted there."""
        with self._cond:
            shards = [shard for shard in self._active if shard.key == key and not shard.done.is_set()]
            for shard in shards:
                self._fail_shard(shard, ShardAborted(f"shard {key} was aborted; {len(shard.results)} of "
                                                     f"{len(shard.rows)} row(s) had finished"))
        return bool(shards)

    def abort_all(self) -> int:
        """Abort every shard running here; how many."""
        with self._cond:
            keys = {shard.key for shard in self._active if not shard.done.is_set()}
        for key in keys:
            self.abort_shard(key)
        return len(keys)

    def engine_reading(self) -> EngineReading | None:
        """The replicas' last readings combined: counts summed, shares and idle time averaged."""
        with self._cond:
            readings = [state.reading for state in self._states if state.reading is not None]
        return combine_readings(readings, time.monotonic()) if readings else None

    def unfinished_requests(self) -> int:
        """Rows handed to replicas and not yet answered."""
        with self._cond:
            return sum(state.rows_out for state in self._states)

    def stats(self) -> dict[str, Any]:
        """The replicas' driver counters (as ShardRunner.stats) summed over the replicas."""
        with self._cond:
            every = [state.stats for state in self._states]
        return {name: round(sum(stats.get(name, 0) for stats in every), 3)
                for name in ("steps", "requests_added", "step_seconds", "idle_seconds", "active_seconds")}

    def close(self) -> None:
        """Fail the shards still running, stop the driver and every replica."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for shard in list(self._active):
                self._fail_shard(shard, RunnerError("the data-parallel runner was closed"))
            replicas = [state.replica for state in self._states if state.replica is not None]
            loading = [state.starting for state in self._states if state.starting is not None]
            self._cond.notify_all()
        for replica in loading:  # its restart thread sees the runner closed and goes no further
            replica.process.kill()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for replica in replicas:
            replica.send(("close",))
        for replica in replicas:
            replica.stop()

    def drive(self) -> None:
        """Run the driver loop on the calling thread until ``close()`` (owner_drives=True)."""
        with self._cond:
            if not self._driven_by_owner or self._thread is not None:
                raise RunnerError("drive() needs a runner made with owner_drives=True, and runs once")
            self._thread = threading.current_thread()
        self._drive()

    def replica_stats(self) -> list[dict[str, Any]]:
        """Each replica's driver counters as it last reported them (ShardRunner.stats)."""
        with self._cond:
            return [dict(state.stats) for state in self._states]

    def rows_outstanding(self) -> list[int]:
        """Rows each replica holds now (handed to it, not yet answered)."""
        with self._cond:
            return [state.rows_out for state in self._states]

    def replica_pids(self) -> list[int | None]:
        """Each replica slot's process id (None while it restarts or after it failed for good)."""
        with self._cond:
            return [state.replica.pid if state.replica is not None else None for state in self._states]

    # ------------------------------------------------------------------ driver
    def _drive(self) -> None:
        while True:
            with self._cond:
                sends = self._take_sends()
                while not sends and not self._closed:
                    self._cond.wait()
                    sends = self._take_sends()
                if self._closed:
                    return
            for replica, message in sends:  # outside the lock: a slow send holds up no one else
                replica.send(message)  # a replica gone meanwhile: its reader fails its shards

    def _take_sends(self) -> list[tuple[ReplicaProcess, tuple[Any, ...]]]:
        """Aborts to send, then queued batches assigned to replicas with room (lock held)."""
        sends: list[tuple[ReplicaProcess, tuple[Any, ...]]] = [(r, ("abort", b)) for r, b in self._aborts]
        self._aborts.clear()
        while self._queue:
            live = [state for state in self._states if state.replica is not None]
            state = min(live, key=lambda s: s.rows_out, default=None)
            if state is None or state.rows_out + len(self._queue[0].positions) > self.replica_rows:
                break
            batch = self._queue.popleft()
            assert state.replica is not None
            state.batches[batch.batch_id] = batch
            state.rows_out += len(batch.positions)
            rows = [batch.shard.rows[position] for position in batch.positions]
            sends.append((state.replica, ("batch", batch.batch_id, rows)))
        return sends

    def _fail_shard(self, shard: _Shard, exc: BaseException) -> None:
        """Fail ``shard`` (lock held): drop its queued batches, abort those on replicas."""
        if shard.done.is_set():
            return
        self._queue = collections.deque(batch for batch in self._queue if batch.shard is not shard)
        for state in self._states:
            for batch in state.batches.values():
                if batch.shard is shard and state.replica is not None:
                    self._aborts.append((state.replica, batch.batch_id))
        shard.fail(exc)
        self._cond.notify_all()

    # ------------------------------------------------- replicas' reader threads
    def _on_message(self, replica: ReplicaProcess, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "reading":
            with self._cond:
                state = self._states[replica.index]
                state.reading, state.stats = message[1], message[2]
            return
        with self._cond:
            batch = self._states[replica.index].batches.get(message[1])
        if batch is None:
            return
        if kind == "rows":
            if batch.shard.on_row is not None and not batch.shard.done.is_set():
                with self._report_lock:  # one report at a time, as from one driver thread
                    for done in message[2]:
                        report_row(batch.shard.on_row, done)  # its index is the row's: replicas get our RowRequests
            return
        with self._cond:
            state = self._states[replica.index]
            state.batches.pop(batch.batch_id, None)
            state.rows_out -= len(batch.positions)
            if kind == "done":
                for position, result in zip(batch.positions, message[2], strict=True):
                    batch.shard.results[position] = result
                if len(batch.shard.results) == len(batch.shard.rows):
                    batch.shard.done.set()
            elif kind == "failed":
                self._fail_shard(batch.shard, RunnerError(
                    f"{replica}'s engine failed while running rows of shard {batch.shard.key}: {message[2]}"))
            self._cond.notify_all()

    def _on_exit(self, replica: ReplicaProcess, how: str) -> None:
        with self._cond:
            state = self._states[replica.index]
            if self._closed or state.replica is not replica:
                return
            logger.error("%s ended (%s) with %d row(s) outstanding", replica, how, state.rows_out)
            state.replica = None
            for batch in list(state.batches.values()):
                shard = batch.shard
                self._fail_shard(shard, RunnerError(
                    f"{replica} ended ({how}) while running rows of shard {shard.key}; {len(shard.results)} of "
                    f"{len(shard.rows)} row(s) had finished; the shard is retried whole"))
            state.batches.clear()
            state.rows_out = 0
            restart = state.restarting = state.restarts < self._max_restarts
            state.restarts += restart
            self._fail_all_if_none_left()
            self._cond.notify_all()
        if restart:
            threading.Thread(target=self._restart, args=(replica.index,), daemon=True,
                             name=f"shardline-replica-{replica.index}-restart").start()

    # ---------------------------------------------------------------- starting
    def _start_all(self) -> None:
        """Start every replica at once and wait until all serve; stop them all on a failure."""
        started: list[ReplicaProcess] = []
        try:
            for index, state in enumerate(self._states):
                started.append(ReplicaProcess(index, self.model, self.engine_options, state.placement))
            for replica in started:
                replica.wait_ready(LOAD_SECONDS)
        except BaseException:
            for replica in started:
                replica.process.kill()
                replica.process.wait()
            raise
        for replica in started:
            self._states[replica.index].replica = replica
            replica.listen(self._on_message, self._on_exit)
        logger.info("%d data-parallel replicas of %s serving: pids %s", self.size, self.model,
                    [replica.pid for replica in started])

    def _fail_all_if_none_left(self) -> None:
        """With no replica serving or restarting, fail every shard (lock held): none would run."""
        if self._none_left():
            for shard in list(self._active):
                self._fail_shard(shard, RunnerError(f"every data-parallel replica of {self.model} has died "
                                                    "and none restarted; see the replicas' errors above"))

    def _none_left(self) -> bool:
        return all(state.replica is None and not state.restarting for state in self._states)

    def _restart(self, index: int) -> None:
        """Start replica ``index`` again (its own thread): it joins the others once it serves."""
        state = self._states[index]
        replica: ReplicaProcess | None = None
        try:
            with self._cond:
                if self._closed:
                    return
                replica = state.starting = ReplicaProcess(index, self.model, self.engine_options, state.placement)
            replica.wait_ready(LOAD_SECONDS)
        except Exception:
            if not self._closed:
                logger.exception("data-parallel replica %d did not restart", index)
            if replica is not None:
                replica.process.kill()
                replica.process.wait()
            replica = None
        with self._cond:
            state.starting, state.restarting = None, False
            closed = self._closed
            if replica is not None and not closed:
                state.replica = replica
                replica.listen(self._on_message, self._on_exit)
                logger.info("%s restarted", replica)
            self._fail_all_if_none_left()
            self._cond.notify_all()
        if replica is not None and closed:
            replica.stop()


def combine_readings(readings: list[EngineReading], now: float) -> EngineReading:
    """One reading for several engines: request and step counts summed, shares averaged."""
    stats = [reading.stats for reading in readings]

    def mean(values: list[float | None]) -> float | None:
        known = [value for value in values if value is not None]
        return sum(known) / len(known) if known else None

    combined = EngineStats(
        num_running=sum(s.num_running for s in stats), num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=mean([s.kv_cache_usage for s in stats]),
        prefix_cache_hit_rate=mean([s.prefix_cache_hit_rate for s in stats]),
        num_preemptions=sum(s.num_preemptions for s in stats), num_steps=sum(s.num_steps for s in stats))
    return EngineReading(combined, sum(r.idle_seconds for r in readings) / len(readings), now)
