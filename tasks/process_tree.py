"""The processes a process started, read from /proc: what a stopping run must not leave behind.

``shardline run`` starts Prefect's temporary API server (a uvicorn process), perhaps
an engine child process, and short-lived compilers. When it is stopped and its
orderly shutdown overruns, ``terminate_descendants`` ends them before it exits,
so nothing is left adopted by init. Linux only (/proc); elsewhere it finds none.
The shared engine service (tasks/engine_client.py) starts in a session of its own
and is meant to outlive its starter; it is never touched here.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (from /proc/<pid>/task/*/children)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # the thread or process ended meanwhile
    return sorted(set(found))


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` in the process tree, parents before children."""
    found: list[int] = []
    frontier = children(pid)
    while frontier:
        found += frontier
        frontier = [child for parent in frontier for child in children(parent)]
    return found


def is_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def command_line(pid: int) -> str:
    """The process's command line, or '' when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def terminate_descendants(pid: int, grace: float = 3.0) -> list[int]:
    """SIGTERM every descendant of ``pid``, SIGKILL those still alive after ``grace``
    seconds; return the pids signalled."""
    targets = [child for child in descendants(pid) if _same_session(child, pid)]
    for child in targets:
        _signal(child, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(is_alive(child) for child in targets) and time.monotonic() < deadline:
        time.sleep(0.05)
    for child in targets:
        if is_alive(child):
            _signal(child, signal.SIGKILL)
    return targets


def _same_session(child: int, pid: int) -> bool:
    """Whether ``child`` runs in ``pid``'s session (a detached engine service does not)."""
    try:
        return os.getsid(child) == os.getsid(pid)
    except OSError:
        return False


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
