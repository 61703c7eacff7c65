"""Progress by rows within and across shards, on the real pipeline and a tiny engine.

Updates are driven by rows: a clock that moves one second per reading stands in for
time, so a sink with a ten-second interval is due about every ten reports whatever
the host's speed, and nothing here sleeps or asserts on wall time.
"""

from __future__ import annotations

import fcntl
import io
import itertools
import logging
import os
import select
import struct
import termios
import threading

import pytest

from shardline.tasks.executor import RowDone
from shardline.tasks.progress import JobProgress, ProgressSnapshot, ThroughputLog
from shardline.tasks.progress_report import TerminalBar, duration, progress_line, show_progress
from shardline.tasks.sample_data import write_rows
from shardline.tasks.shard_job import ShardPipeline
from shardline.tasks.storage import Shard, list_shards
from shardline.tasks.summary import job_summary, summary_markdown, summary_table

from ..waiting import wait_for


class StepClock:
    """A clock that moves ``step`` seconds each time it is read."""

    def __init__(self, step: float = 1.0) -> None:
        self._ticks = itertools.count()
        self.step = step

    def __call__(self) -> float:
        return next(self._ticks) * self.step


def _prompts(count: int, start: int = 0) -> list[dict]:
    return [{"id": f"r{i}", "prompt": f"Row {i} tells of the sea" if i % 17 else ""} for i in range(start, count)]


def test_a_long_shard_reports_rows_as_they_finish(tmp_path, make_job):
    write_rows(str(tmp_path / "in" / "big.parquet"), _prompts(60))
    [shard] = list_shards(str(tmp_path / "in"))
    progress = JobProgress([shard], clock=StepClock())
    seen: list[ProgressSnapshot] = []
    progress.add_sink(seen.append, every_seconds=10)
    manifest = ShardPipeline(make_job(), progress=progress).process(shard)
    during = [snapshot for snapshot in seen if snapshot.rows_known == 60 and snapshot.rows_done < 60]
    assert len(during) >= 3, [s.rows_done for s in seen]  # the shard's own rows moved the lines along
    assert [s.rows_done for s in seen] == sorted(s.rows_done for s in seen)
    assert all(s.shards_finished == 0 and s.shards_unread == 0 and s.rows_expected == 60 for s in during)
    assert during[-1].completion_tokens > 0 and during[-1].tokens_per_second > 0
    assert during[-1].eta_seconds is not None and during[-1].eta_seconds > 0
    engine = during[-1].engine
    assert engine is not None and engine.kv_cache_usage is not None and engine.preemptions == 0
    assert engine.starved_share is not None and 0.0 <= engine.starved_share <= 1.0
    progress.shard_finished(shard.key, manifest)
    final = progress.finish()
    assert (final.rows_done, final.rows_known, final.errors, final.completion_tokens) == \
        (60, 60, manifest.errors, manifest.completion_tokens)
    assert manifest.errors == 4 and final.fraction == 1.0 and final.eta_seconds == 0.0  # rows 0, 17, 34, 51
    assert final.shards_finished == final.shards_total == 1


def test_without_a_terminal_a_line_every_interval_goes_to_the_log(tmp_path, make_job, caplog):
    write_rows(str(tmp_path / "in" / "big.parquet"), _prompts(40))
    [shard] = list_shards(str(tmp_path / "in"))
    progress = JobProgress([shard], clock=StepClock())
    stderr = io.StringIO()  # not a terminal
    log = logging.getLogger("test.progress")
    assert show_progress(progress, log, stderr, interval_seconds=15) is None
    with caplog.at_level(logging.INFO, logger="test.progress"):
        ShardPipeline(make_job(), progress=progress).process(shard)
    lines = [record.getMessage() for record in caplog.records if record.name == "test.progress"]
    assert len(lines) >= 2 and stderr.getvalue() == ""
    assert all(line.startswith("progress: rows ") and " of 40 " in line and "tok/s" in line for line in lines)
    assert "ETA" in lines[-1] and "engine: " in lines[-1] and "KV cache" in lines[-1]


def test_on_a_terminal_a_bar_is_drawn(tmp_path):
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a terminal of 160 columns
    with os.fdopen(follower, "w") as terminal:
        progress = JobProgress([Shard("file:///x.parquet", "x", "parquet", 1000)], clock=StepClock())
        bar = show_progress(progress, logging.getLogger("test.progress"), terminal)
        assert isinstance(bar, TerminalBar)
        progress.shard_read("x", 10)
        for index in range(10):
            progress.row_done("x", RowDone(index, 3, failed=False))
        progress.finish()
        bar.close()
    drawn = _read_all(leader)
    assert "rows" in drawn and "10/10" in drawn and "tok/s" in drawn


def _read_all(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 0)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the terminal's other end is closed and everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def test_a_json_lines_shard_counts_once_read_and_the_rest_is_estimated_by_size(tmp_path, make_job):
    write_rows(str(tmp_path / "in" / "a.parquet"), _prompts(12))
    write_rows(str(tmp_path / "in" / "b.jsonl"), _prompts(30, start=12))
    first, second = list_shards(str(tmp_path / "in"))
    progress = JobProgress([first, second], clock=StepClock())
    before = progress.snapshot()
    assert (before.rows_known, before.rows_expected, before.shards_unread, before.fraction) == (0, None, 2, None)
    assert "? expected" in progress_line(before) and "ETA ?" in progress_line(before)
    pipeline = ShardPipeline(make_job(), progress=progress)
    progress.shard_finished(first.key, pipeline.process(first))
    middle = progress.snapshot()
    assert (middle.rows_known, middle.rows_done, middle.shards_unread) == (12, 12, 1)
    assert middle.rows_expected == 12 + round(12 / first.size * second.size)  # b's rows are not known yet
    assert "1 shard(s) not read yet" in progress_line(middle)
    progress.shard_finished(second.key, pipeline.process(second))
    end = progress.snapshot()
    assert (end.rows_known, end.rows_done, end.rows_expected, end.shards_unread) == (30, 30, 30, 0)


def test_a_failed_shard_leaves_the_totals_and_a_retry_counts_afresh():
    shards = [Shard(f"file:///{key}.jsonl", key, "jsonl", 100) for key in ("a", "b")]
    progress = JobProgress(shards, shards_done_before=1, clock=StepClock())
    for _attempt in range(2):  # a task retry reads the shard again
        progress.shard_read("a", 5, errors=1)
        for index in range(3):
            progress.row_done("a", RowDone(index, 2, failed=index == 0))
    snapshot = progress.snapshot()
    assert (snapshot.rows_known, snapshot.rows_done, snapshot.errors, snapshot.completion_tokens) == (5, 4, 2, 6)
    progress.shard_finished("a", None)
    failed = progress.snapshot()
    assert (failed.rows_known, failed.rows_done, failed.shards_finished, failed.shards_failed) == (0, 0, 2, 1)
    assert failed.shards_total == 3 and "(1 failed)" in progress_line(failed)


def test_a_failing_sink_never_stops_the_rows(tmp_path, make_job, caplog):
    write_rows(str(tmp_path / "in" / "s.parquet"), _prompts(10))
    [shard] = list_shards(str(tmp_path / "in"))
    progress = JobProgress([shard], clock=StepClock())

    def broken(snapshot: ProgressSnapshot) -> None:
        raise ConnectionError("the API is down")

    progress.add_sink(broken, every_seconds=0)
    with caplog.at_level(logging.WARNING, logger="shardline.tasks.progress"):
        manifest = ShardPipeline(make_job(), progress=progress).process(shard)
    assert manifest.rows == 10 and "a progress report failed" in caplog.text


@pytest.mark.parametrize(("seconds", "text"), [(None, "?"), (4.4, "4s"), (185, "3m05s"), (3725, "1h02m")])
def test_durations_read_as_a_person_would(seconds, text):
    assert duration(seconds) == text


def test_throughput_spans_read_the_counts_between_points_and_chart_them():
    log = ThroughputLog()
    for elapsed, rows, tokens in [(10.0, 10, 100), (20.0, 30, 300), (30.0, 30, 300), (40.0, 30, 300)]:
        log(ProgressSnapshot(elapsed, 1, 0, 0, 0, rows, 30, 30, 0, tokens, 0.0, 0.0, None))
    spans = log.spans(count=4)  # 10 s each: 1 row/s, then 2 rows/s, then nothing for 20 s
    assert [(s["from_seconds"], s["to_seconds"]) for s in spans] == [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert [s["rows_per_second"] for s in spans] == [1.0, 2.0, 0.0, 0.0]
    assert [s["tokens_per_second"] for s in spans] == [10.0, 20.0, 0.0, 0.0]
    summary = job_summary([], 40.0, "out")
    summary["throughput"] = spans
    table = summary_table(summary).splitlines()
    assert table[-5] == "throughput over the run (output tokens/s):"
    assert table[-3].endswith("20.0 tok/s      2.00 rows/s  " + "█" * 30) and table[-4].endswith("█" * 15)
    assert "| 0:00:10 | 0:00:20 | 2.00 | 20.0 | " + "█" * 30 + " |" in summary_markdown(summary)
    assert ThroughputLog().spans() == []  # a run that never reported


def test_the_heartbeat_reports_while_no_row_finishes_and_finishes_at_the_end():
    progress = JobProgress([Shard("file:///x.jsonl", "x", "jsonl", 10)])
    seen: list[ProgressSnapshot] = []
    heard = threading.Event()

    def sink(snapshot: ProgressSnapshot) -> None:
        seen.append(snapshot)
        heard.set()

    progress.add_sink(sink, every_seconds=0)
    with progress.heartbeat(0.1):
        wait_for(heard.is_set, "a heartbeat report with no row reported")
        assert seen[0].rows_known == 0 and seen[0].shards_unread == 1
        progress.shard_read("x", 2)
        progress.row_done("x", RowDone(0, 4, failed=False))
        progress.row_done("x", RowDone(1, 0, failed=True))
    assert (seen[-1].rows_done, seen[-1].errors, seen[-1].completion_tokens) == (2, 1, 4)  # finish() came last


def test_rates_and_eta_count_from_the_first_row_not_the_engines_load():
    now = [0.0]
    progress = JobProgress([Shard("file:///x.jsonl", "x", "jsonl", 10)], clock=lambda: now[0])
    progress.shard_read("x", 10, errors=1)  # one row refused at read: done at once
    now[0] = 100.0  # the model took 100 s to load
    for index in range(5):
        progress.row_done("x", RowDone(index, 6, failed=False))
        now[0] += 2.0
    snapshot = progress.snapshot()  # 5 rows and 30 tokens in the 10 s since the first row came back
    assert (snapshot.rows_done, snapshot.elapsed_seconds) == (6, 110.0)
    assert (snapshot.rows_per_second, snapshot.tokens_per_second) == (0.5, 3.0)
    assert snapshot.eta_seconds == 8.0  # 4 rows left at 0.5 rows/s
