"""The cache of CPU path measurements (engine/cpu/measurement.py): read once per
change of the file, bounded, and a file another process rewrote is read anew."""

from __future__ import annotations

import json

from shardline.engine.cpu import measurement


def test_hits_are_not_measured_again_and_a_rewritten_file_is_read_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))
    calls = []

    def measure() -> float:
        calls.append(1)
        return 1.5

    assert measurement.measured("kind", ("a",), measure) == 1.5
    assert measurement.measured("kind", ("a",), measure) == 1.5
    assert len(calls) == 1
    path = tmp_path / "cpu_paths.json"
    (entry,) = json.loads(path.read_text())
    path.write_text(json.dumps({entry: 0.25}))  # same size as before is not assumed: new bytes
    assert measurement.measured("kind", ("a",), measure) == 0.25
    path.write_text("not json")
    assert measurement.measured("kind", ("a",), measure) == 1.5 and len(calls) == 2


def test_the_file_keeps_the_newest_measurements(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measurement, "MAX_ENTRIES", 3)
    for index in range(5):
        measurement.measured("kind", (index,), lambda index=index: float(index))
    kept = json.loads((tmp_path / "cpu_paths.json").read_text())
    assert sorted(kept.values()) == [2.0, 3.0, 4.0]
    calls = []
    assert measurement.measured("kind", (0,), lambda: calls.append(1) or 7.0) == 7.0  # dropped: measured again
    assert calls == [1]



def test_a_process_waits_for_another_measuring_and_reads_its_result(tmp_path, monkeypatch):
    """Workers loading one model together (a Ray node's) race each shape once between them."""
    import fcntl
    import threading

    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))
    calls, results = [], []
    with open(tmp_path / "cpu_paths.lock", "w") as other_process:  # another open file: another holder
        fcntl.flock(other_process, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: results.append(
            measurement.measured("kind", ("a",), lambda: calls.append(1) or 9.0)))
        waiter.start()
        waiter.join(timeout=0.3)
        assert waiter.is_alive() and not calls  # waiting, not measuring beside the other
        (tmp_path / "cpu_paths.json").write_text(json.dumps({measurement.entry_name("kind", ("a",)): 2.5}))
    waiter.join(timeout=10)
    assert results == [2.5] and not calls  # the other process's measurement, read after the wait
    assert measurement.measured("kind", ("b",), lambda: 4.0) == 4.0  # the lock was given up
