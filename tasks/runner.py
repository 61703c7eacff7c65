"""The shard runner: one driver thread streams the rows of many shards through one engine.

Invariants:
- Only the driver thread touches the engine (chat rendering, add_request, step,
  abort_request). Shard callers, from any thread, hand over their rows and wait
  for their shard's last row; nothing else needs a lock around the engine. Rows
  with images are the exception: the caller's thread prepares their prompts
  (tasks/image_prompts.py; the tokenizer and processor are only read).
- The driver adds rows while the engine reports capacity (or up to ``max_queued``
  requests when given), taking rows from shards in the order the shards arrived, so the batch stays full across shard
  boundaries and the earliest shard finishes (and is written) first.
- Request ids are ``<shard key>@<n>:<row>`` (``<n>``: the shard's serial in this
  runner, so two shards with the same key — partitions whose files share a stem —
  never share an id; ``~<n>`` appended on a retry), and every output maps back to
  its shard and row.
- ``abort_shard`` only records the key; the driver aborts that shard's requests
  between two steps, so aborting too never touches the engine from another thread.

A step that raises names no culprit. Every request in flight is aborted and those
rows go to recovery, which runs them alone (no new rows are admitted meanwhile):
a failing group is retried after an exponential backoff, bisected on each failure
until the poison row stands alone, and that row becomes an error row after
``max_row_attempts``; every other row completes normally.
An error that says the engine itself is gone (a tensor-parallel rank died) is not a
row's: the driver stops, every shard it holds fails (the pipeline retries them as any
failed shard), and ``failure`` tells the engine cache to load a new engine.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .executor import EngineReading, RowCallback, RowRequest, RowResult, RunnerError, ShardAborted
from .image_prompts import has_images, image_prompt, prepare_image_rows
from .shard_work import DriverStats, RetryPolicy, ShardWork, engine_is_gone, row_output

if TYPE_CHECKING:
    from shardline import LLM

    from .shard_work import EngineOutput

logger = logging.getLogger("shardline.tasks.runner")

# (shard work, position of the row in that shard's request list)
_Entry = tuple[ShardWork, int]

DEFAULT_RETRY = RetryPolicy()


class ShardRunner:
    """Streams shards through one ``LLM``'s engine from a single driver thread: the
    in-process ShardExecutor (tasks/executor.py)."""

    def __init__(self, llm: LLM, max_queued: int | None = None, retry: RetryPolicy = DEFAULT_RETRY,
                 owner_drives: bool = False) -> None:
        self.llm = llm
        # The pipeline's only reach past the LLM API, kept in this class: the driver steps the
        # engine itself (llm.llm_engine, vLLM's public engine object, llm.Engine)
        # so the rows of many shards share one batch.
        self._engine = llm.llm_engine
        self._max_queued = max_queued
        self._retry = retry
        self._cond = threading.Condition()
        self._queue: collections.deque[ShardWork] = collections.deque()
        self._in_flight: dict[str, _Entry] = {}
        self._active: set[ShardWork] = set()  # submitted, not yet returned to their caller
        self._retry_ids = itertools.count(1)
        self._shard_serials = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._driven_by_owner = owner_drives  # the owner calls drive(); run_shard starts no thread
        self._closed = False
        self._abort_keys: set[str] = set()  # shards to abort, handed to the driver
        self._stats = DriverStats()  # written by the driver thread only
        self._reading: EngineReading | None = None  # the engine's load after the last step (driver)
        self.failure: BaseException | None = None  # what stopped the driver: the engine cannot go on

    def run_shard(self, key: str, rows: list[RowRequest], on_row: RowCallback | None = None) -> list[RowResult]:
        """Run ``rows`` (of shard ``key``) and return one RowResult each, in order; ``on_row``
        is told of each as it finishes (on the driver thread)."""
        work = ShardWork(key, list(rows), f"{key}@{next(self._shard_serials)}", on_row)
        if not work.rows:
            return []
        work.prepared = prepare_image_rows(self.llm, work.rows, work.request_prefix)  # off the driver thread
        with self._cond:
            if self._closed:
                raise RunnerError("the shard runner is closed")
            self._queue.append(work)
            self._active.add(work)
            if not self._driven_by_owner and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._drive, name="shardline-engine-driver", daemon=True)
                self._thread.start()
            self._cond.notify()
        work.done.wait()
        with self._cond:
            self._active.discard(work)
        if isinstance(work.failure, ShardAborted):
            raise work.failure
        if work.failure is not None:
            raise RunnerError(f"the engine driver failed while running shard {key}: {work.failure}") \
                from work.failure
        return [work.results[position] for position in range(len(work.rows))]

    def abort_shard(self, key: str) -> bool:
        """Abort shard ``key``: the driver drops its queued rows and aborts its requests in
        the engine, and its ``run_shard`` call raises ShardAborted. Other shards go on.
        Callable from any thread (or a signal handler: the condition's lock is
        reentrant). Returns whether the shard was running here."""
        with self._cond:
            if not any(work.key == key and not work.done.is_set() for work in self._active):
                return False
            self._abort_keys.add(key)
            self._cond.notify()
        return True

    def abort_all(self) -> int:
        """Abort every shard this runner holds (as ``abort_shard`` does each); return how many."""
        with self._cond:
            keys = {work.key for work in self._active if not work.done.is_set()}
            self._abort_keys |= keys
            self._cond.notify()
        return len(keys)

    def unfinished_requests(self) -> int:
        """Requests in the engine now (a read of a counter, any thread)."""
        return self._engine.get_num_unfinished_requests()

    def stats(self) -> dict[str, Any]:
        """The driver's counters so far (DriverStats.as_dict); a snapshot, any thread."""
        return self._stats.as_dict()

    def engine_reading(self) -> EngineReading | None:
        """The engine's load after the last step (the driver reads it), with the driver's idle
        seconds up to now; any thread."""
        reading, idle_since, now = self._reading, self._stats.idle_since, time.monotonic()
        idle = self._stats.idle_seconds + (now - idle_since if idle_since is not None else 0.0)
        return None if reading is None else EngineReading(reading.stats, idle, now)

    def close(self) -> None:
        """Stop the driver; shards still waiting fail with RunnerError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread() \
                and not self._driven_by_owner:
            self._thread.join()

    def drive(self) -> None:
        """Run the driver loop in the calling thread until ``close()``.

        For a runner made with ``owner_drives=True`` in a process whose main thread has
        nothing else to do (the engine service): the engine loop gets that thread, and
        shard callers, each on a thread of its own, only wait for their results."""
        with self._cond:
            if not self._driven_by_owner or self._thread is not None:
                raise RunnerError("drive() needs a runner made with owner_drives=True, and runs once")
            self._thread = threading.current_thread()
        self._drive()

    # ------------------------------------------------------------ driver thread
    def _drive(self) -> None:
        try:
            while self._wait_for_work():
                self._abort_requested()
                self._admit()
                if self._in_flight:
                    self._step()
        except BaseException as exc:  # a bug or an engine that cannot go on
            logger.exception("engine driver failed")
            self.failure = exc
            self._fail_everything(exc)
            return
        self._fail_everything(RunnerError("the shard runner was closed"))

    def _wait_for_work(self) -> bool:
        with self._cond:
            if not self._closed and not self._queue and not self._in_flight:
                waited = self._stats.idle_since = time.monotonic()
                while not self._closed and not self._queue and not self._in_flight:
                    self._cond.wait()
                self._stats.idle_seconds += time.monotonic() - waited
                self._stats.idle_since = None
            return not self._closed

    def _abort_requested(self) -> None:
        """Abort the shards ``abort_shard`` named (driver thread: it alone touches the engine)."""
        if not self._abort_keys:  # read without the lock: a key added meanwhile waits one step
            return
        with self._cond:
            keys, self._abort_keys = self._abort_keys, set()
            aborted = [work for work in self._active if work.key in keys and not work.done.is_set()]
            for work in aborted:
                if work in self._queue:
                    self._queue.remove(work)
        request_ids = [rid for rid, (work, _) in self._in_flight.items() if work.key in keys]
        self._engine.abort_request(request_ids)
        for request_id in request_ids:
            del self._in_flight[request_id]
        for work in aborted:
            work.failure = ShardAborted(f"shard {work.key} was aborted; {len(work.results)} of "
                                        f"{len(work.rows)} row(s) had finished")
            work.done.set()

    def _admit(self) -> None:
        """Add rows, oldest shard first, while the engine has room for them."""
        while self._has_room():
            with self._cond:
                if not self._queue:
                    return
                work = self._queue[0]
                position = work.next_row
                work.next_row += 1
                if work.next_row == len(work.rows):
                    self._queue.popleft()
            request_id = f"{work.request_prefix}:{work.rows[position].index}"
            if self._add(request_id, work, position):
                self._in_flight[request_id] = (work, position)

    def _has_room(self) -> bool:
        if self._max_queued is not None:
            return len(self._in_flight) < self._max_queued
        return not self._in_flight or self._engine.has_capacity()  # never stall with nothing to step

    def _add(self, request_id: str, work: ShardWork, position: int) -> bool:
        """Add one row; a row the engine refuses becomes an error row (False)."""
        row = work.rows[position]
        try:
            prompt = work.prepared.get(position) or self._render(row)
            if isinstance(prompt, ValueError):
                raise prompt
            self._engine.add_request(request_id, prompt, row.params, lora_request=row.lora_request,
                                     priority=row.priority)
            self._stats.requests_added += 1
            return True
        except Exception as exc:
            self._engine.abort_request(request_id)  # in case it got partly in
            message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            work.complete(position, RowResult(row.index, error=message))
            return False

    def _render(self, row: RowRequest) -> str | dict[str, Any]:
        assert row.images is None, f"row {row.index}: its images are read before the engine (tasks/image_feed.py)"
        if has_images(row):
            return image_prompt(self.llm, row)
        if row.messages is None:
            assert row.prompt is not None, f"row {row.index} has neither a prompt nor messages"
            return row.prompt
        return {"prompt_token_ids": self.llm.render_chat(row.messages, **(row.chat_options or {}))}

    def _step(self) -> None:
        self._check_engine_has_work(self._in_flight)
        try:
            outputs = self._engine_step()
        except Exception as exc:
            self._recover(exc)
            return
        for output in outputs:
            entry = self._in_flight.pop(output.request_id, None)
            if entry is not None:  # None: the last word of an aborted request
                work, position = entry
                work.complete(position, RowResult(work.rows[position].index, output=row_output(output)))

    def _engine_step(self) -> Sequence[EngineOutput]:
        """One engine step, counted in the driver's stats (failed steps too)."""
        started = time.monotonic()
        try:
            return self._engine.step()
        finally:
            stats, ended = self._stats, time.monotonic()
            stats.steps += 1
            stats.step_seconds += ended - started
            stats.first_step_at = stats.first_step_at or started
            stats.last_step_at = ended
            self._read_engine(ended)

    def _read_engine(self, now: float) -> None:
        """Record the engine's load after a step (logged per step at debug level)."""
        self._reading = EngineReading(self._engine.stats(), self._stats.idle_seconds, now)
        logger.debug("step %d: %s", self._stats.steps, self._reading.stats)

    # ----------------------------------------------------------------- recovery
    def _recover(self, exc: Exception) -> None:
        if engine_is_gone(exc):
            raise exc
        suspects = list(self._in_flight.values())
        self._engine.abort_request(list(self._in_flight))
        self._in_flight.clear()
        logger.warning("engine step failed (%s: %s); isolating %d in-flight row(s)",
                       type(exc).__name__, exc, len(suspects))
        self._isolate(suspects, depth=1)

    def _isolate(self, group: list[_Entry], depth: int, row_attempt: int = 1) -> None:
        """Run ``group`` alone after a backoff; on failure bisect, or retry a lone row."""
        time.sleep(self._retry.delay(depth))
        failure, unfinished = self._run_alone(group)
        if failure is None:
            return
        if len(unfinished) > 1:
            middle = len(unfinished) // 2
            self._isolate(unfinished[:middle], depth + 1)
            self._isolate(unfinished[middle:], depth + 1)
        elif row_attempt < self._retry.max_row_attempts:
            self._isolate(unfinished, depth + 1, row_attempt + 1)
        else:
            work, position = unfinished[0]
            work.complete(position, RowResult(work.rows[position].index, error=(
                f"the engine failed while running this row ({type(failure).__name__}: {failure}); "
                f"isolated by bisection and retried {row_attempt} time(s) alone"
            )))

    def _run_alone(self, group: list[_Entry]) -> tuple[Exception | None, list[_Entry]]:
        """Step ``group`` to completion with nothing else in the engine.

        Returns (None, []) on success, else the error and the rows that had not
        finished (their requests already aborted)."""
        pending: dict[str, _Entry] = {}
        suffix = next(self._retry_ids)
        for work, position in group:
            request_id = f"{work.request_prefix}:{work.rows[position].index}~{suffix}"
            if self._add(request_id, work, position):
                pending[request_id] = (work, position)
        try:
            while pending:
                self._check_engine_has_work(pending)
                for output in self._engine_step():
                    entry = pending.pop(output.request_id, None)
                    if entry is not None:
                        work, position = entry
                        work.complete(position, RowResult(work.rows[position].index, output=row_output(output)))
        except Exception as exc:
            if engine_is_gone(exc):
                raise
            self._engine.abort_request(list(pending))
            return exc, list(pending.values())
        return None, []

    def _check_engine_has_work(self, expected: dict[str, _Entry]) -> None:
        if expected and not self._engine.has_unfinished_requests():
            raise RunnerError(f"the engine lost {len(expected)} request(s), e.g. {next(iter(expected))!r}")

    def _fail_everything(self, exc: BaseException) -> None:
        with self._cond:
            waiting = [work for work in self._active if not work.done.is_set()]
            self._queue.clear()
        try:
            self._engine.abort_request(list(self._in_flight))
        finally:
            self._in_flight.clear()
            for work in waiting:
                work.failure = exc
                work.done.set()
