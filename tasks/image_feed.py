"""Rows' images fetched and decoded ahead of the engine, with bounded memory.

``ImageFeed`` is a ShardExecutor (tasks/executor.py) over the engine host's: a shard
whose rows carry images is run as windows of rows whose images are ready, each
handed to the engine host under a key of its own (``<shard key>#images-<n>``), so
the engine starts on the first images while later ones are still read.

Invariants:
- Decoded images held (fetched, not yet through the engine) never exceed
  ``ImageOptions.prefetch_bytes``, except one image larger than that alone; besides
  them each fetch worker holds at most one row's encoded images. (The model's
  processor output for them, tasks/image_prompts.py, lives as long as their window,
  and is not counted.)
- A row whose image cannot be read or decoded gets a RowResult with the error (naming
  the row and the image) and never reaches the engine; the other rows go on.
- A window is handed over in any order (results are keyed by row index), so a row
  waiting for memory never blocks the windows that would free it.
- ``abort_shard`` stops fetching and aborts every window of the shard; its
  ``run_shard`` raises ShardAborted. A failed window fails the shard the same way
  the engine host's failure would.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .executor import (
    EngineReading,
    RowCallback,
    RowRequest,
    RowResult,
    ShardAborted,
    ShardExecutor,
    report_row,
    row_done,
)
from .media import (
    IMAGE_MARKER_TYPE,
    ImageError,
    ImageOptions,
    ImageSource,
    decode_image,
    decoded_size,
    read_image_bytes,
)

FETCH_WORKERS = 8
WINDOW_ROWS = 32  # rows handed over together once that many are ready (fewer in the first windows)
FIRST_WINDOW_ROWS = 4  # the first window's; each next one doubles, up to WINDOW_ROWS
MAX_WINDOWS = 16  # windows of one shard on the engine at once


def resolve_images(request: RowRequest, images: list[Any]) -> RowRequest:
    """``request`` with its decoded ``images`` in place: a prompt's as ``multi_modal_data``,
    a chat's as ``image_pil`` parts where its image markers stand."""
    if request.messages is None:
        return dataclasses.replace(request, images=None, multi_modal_data={"image": list(images)})
    remaining = iter(images)
    messages = []
    for message in request.messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [{"type": "image_pil", "image_pil": next(remaining)}
                       if isinstance(part, dict) and part.get("type") == IMAGE_MARKER_TYPE else part
                       for part in content]
            message = {**message, "content": content}
        messages.append(message)
    assert next(remaining, None) is None, f"row {request.index}: one image per marker"
    return dataclasses.replace(request, images=None, messages=messages)


class _Budget:
    """Bytes of decoded images held; ``take`` waits until there is room (a lone image
    larger than the limit is let through when nothing else is held)."""

    def __init__(self, limit: int, cond: threading.Condition) -> None:
        self.limit, self.held, self.peak, self._cond = limit, 0, 0, cond

    def take(self, size: int, stopped: threading.Event) -> bool:
        with self._cond:
            while self.held and self.held + size > self.limit and not stopped.is_set():
                self._cond.wait()
            if stopped.is_set():
                return False
            self.held += size
            self.peak = max(self.peak, self.held)
            return True

    def give(self, size: int) -> None:
        with self._cond:
            self.held -= size
            self._cond.notify_all()


class _ShardFeed:
    """One shard's rows through fetch workers and windows (the work of one ``run_shard``)."""

    def __init__(self, inner: ShardExecutor, key: str, rows: list[RowRequest], options: ImageOptions,
                 storage_options: dict[str, Any], on_row: RowCallback | None) -> None:
        self.inner, self.key, self.rows, self.on_row = inner, key, rows, on_row
        self.options, self.storage_options = options, storage_options
        self.cond = threading.Condition()
        self.budget = _Budget(options.prefetch_bytes, self.cond)
        self.stopped = threading.Event()
        self.results: dict[int, RowResult] = {}
        self.ready: list[tuple[RowRequest, int]] = [(row, 0) for row in rows if not row.images]
        self.to_fetch = iter([row for row in rows if row.images])
        self.fetching = 0  # workers reading or decoding now (not waiting for room)
        self.windows: dict[str, list[RowRequest]] = {}  # window key -> its rows, while on the engine
        self.window_ids = itertools.count(1)
        self.window_rows = FIRST_WINDOW_ROWS  # small first windows: the engine starts on the first images
        self.failure: BaseException | None = None

    def run(self) -> list[RowResult]:
        workers = min(FETCH_WORKERS, sum(1 for row in self.rows if row.images))
        fetchers = ThreadPoolExecutor(max(workers, 1), thread_name_prefix="shardline-images")
        windows = ThreadPoolExecutor(MAX_WINDOWS, thread_name_prefix="shardline-image-windows")
        try:
            for _ in range(workers):
                fetchers.submit(self._fetch_rows)
            self._hand_over(windows)
        finally:  # every row has its result, or the shard failed: fetchers stop after their row
            self.stopped.set()
            with self.cond:
                self.cond.notify_all()
            fetchers.shutdown(wait=self.failure is None)  # a failed shard does not wait out a slow read
            windows.shutdown(wait=True)
        if self.failure is not None:
            raise self.failure
        return [self.results[row.index] for row in self.rows]

    def abort(self) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = ShardAborted(f"shard {self.key} was aborted while its images were fed to the engine")
            self.stopped.set()
            keys = list(self.windows)
            self.cond.notify_all()
        for key in keys:
            self.inner.abort_shard(key)

    # ----------------------------------------------------------- handing over
    def _hand_over(self, pool: ThreadPoolExecutor) -> None:
        """Hand ready rows to the engine host, window by window, until every row has a result."""
        with self.cond:
            while self.failure is None and len(self.results) < len(self.rows):
                idle = self.fetching == 0
                if self.ready and (len(self.ready) >= self.window_rows or idle):
                    window, self.ready = self.ready[:WINDOW_ROWS * 4], self.ready[WINDOW_ROWS * 4:]
                    self.window_rows = min(WINDOW_ROWS, 2 * self.window_rows)
                    window_key = f"{self.key}#images-{next(self.window_ids)}"
                    self.windows[window_key] = [row for row, _ in window]
                    pool.submit(self._run_window, window_key, window)
                else:
                    self.cond.wait()

    def _run_window(self, window_key: str, window: list[tuple[RowRequest, int]]) -> None:
        if self.failure is not None:  # queued behind windows of a shard that has failed since
            return
        try:
            results = self.inner.run_shard(window_key, [row for row, _ in window], on_row=self.on_row)
        except BaseException as exc:  # the engine host failed or the shard was aborted: the shard stops
            with self.cond:
                self.windows.pop(window_key, None)
                others = list(self.windows)
                first = self.failure is None
                self.failure = self.failure or exc
                self.stopped.set()
                self.cond.notify_all()
            if first:
                for key in others:
                    self.inner.abort_shard(key)
            return
        with self.cond:
            self.windows.pop(window_key, None)
            for result in results:
                self.results[result.index] = result
            self.cond.notify_all()
        self.budget.give(sum(size for _, size in window))

    # --------------------------------------------------------------- fetching
    def _fetch_rows(self) -> None:
        while not self.stopped.is_set():
            with self.cond:
                row = next(self.to_fetch, None)
                if row is None:
                    return
                self.fetching += 1
            try:
                self._fetch_row(row)
            except BaseException as exc:  # not an image's fault (those are error rows): a bug, out of memory
                with self.cond:
                    self.failure = self.failure or exc
                    self.stopped.set()
            finally:
                with self.cond:
                    self.fetching -= 1
                    self.cond.notify_all()

    def _fetch_row(self, row: RowRequest) -> None:
        """Read, size and decode ``row``'s images; the row is ready, or has its error result."""
        sources: list[ImageSource] = row.images or []
        try:
            encoded = [read_image_bytes(source, self.options, self.storage_options) for source in sources]
            whats = [self._what(row, number, source) for number, source in enumerate(sources, start=1)]
            size = sum(decoded_size(data, what) for data, what in zip(encoded, whats, strict=True))
        except ImageError as exc:
            self._fail_row(row, str(exc))
            return
        with self.cond:
            self.fetching -= 1  # waiting for room is not fetching: the hand-over may go on
            self.cond.notify_all()
        took = self.budget.take(size, self.stopped)
        with self.cond:
            self.fetching += 1
        if not took:
            return
        try:
            images = [decode_image(data, what) for data, what in zip(encoded, whats, strict=True)]
        except ImageError as exc:
            self.budget.give(size)
            self._fail_row(row, str(exc))
            return
        with self.cond:
            self.ready.append((resolve_images(row, images), size))
            self.cond.notify_all()

    def _what(self, row: RowRequest, number: int, source: ImageSource) -> str:
        count = len(row.images or [])
        return f"row {row.index}: image {number}" + (f" of {count}" if count > 1 else "") + f" ({source.describe()})"

    def _fail_row(self, row: RowRequest, reason: str) -> None:
        message = reason if reason.startswith(f"row {row.index}:") else f"row {row.index}: {reason}"
        result = RowResult(row.index, error=message)
        if self.on_row is not None:
            report_row(self.on_row, row_done(result))
        with self.cond:
            self.results[row.index] = result
            self.cond.notify_all()


class ImageFeed:
    """A ShardExecutor that reads and decodes rows' images ahead of ``inner`` (which it
    does not own: ``close`` leaves it open)."""

    def __init__(self, inner: ShardExecutor, options: ImageOptions, storage_options: dict[str, Any]) -> None:
        self.inner, self.options, self.storage_options = inner, options, storage_options
        self._lock = threading.RLock()  # reentrant: abort may run in a signal handler
        self._feeds: dict[str, list[_ShardFeed]] = {}
        self._closed = False
        self.peak_bytes = 0  # the most decoded image bytes one shard held at once, over every shard run here

    def run_shard(self, key: str, rows: list[RowRequest], on_row: RowCallback | None = None) -> list[RowResult]:
        """Run ``rows`` of shard ``key``, their images read ahead; one RowResult each, in order."""
        feed = _ShardFeed(self.inner, key, rows, self.options, self.storage_options, on_row)
        with self._lock:
            if self._closed:
                raise ShardAborted(f"shard {key} not started: the image feed is closed")
            self._feeds.setdefault(key, []).append(feed)
        try:
            return feed.run()
        finally:
            with self._lock:
                self.peak_bytes = max(self.peak_bytes, feed.budget.peak)
                self._feeds[key].remove(feed)
                if not self._feeds[key]:
                    del self._feeds[key]

    def abort_shard(self, key: str) -> bool:
        with self._lock:
            feeds = list(self._feeds.get(key, []))
        for feed in feeds:
            feed.abort()
        return bool(feeds)

    def abort_all(self) -> int:
        with self._lock:
            keys = list(self._feeds)
        return sum(self.abort_shard(key) for key in keys)

    def engine_reading(self) -> EngineReading | None:
        return self.inner.engine_reading()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.abort_all()
