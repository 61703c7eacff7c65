"""Starting, talking to and stopping data-parallel replica processes (tasks/replica.py).

Placement: replica ``i`` of ``n`` gets devices ``i*k .. i*k+k-1`` of this process's
visible CUDA devices (``k``: the engine's tensor_parallel_size, 1 without it) through
its own ``CUDA_VISIBLE_DEVICES``; on a CPU host each gets ``cpus // n`` threads (at
least one). A job asking for more devices than are visible is refused before any
replica starts.

Each replica is a child process in this process's session (so tasks/process_tree.py's
``terminate_descendants`` ends it with its parent) connected by a socket pair: when
this process dies, the replica sees its end of the pair close and exits.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .executor import RunnerError

logger = logging.getLogger("shardline.tasks.replicas")

STOP_SECONDS = 30.0  # how long a closing replica may take before it is killed


@dataclass(frozen=True)
class Placement:
    """Where one replica runs: its CUDA devices (None on CPU) and its CPU threads (None: torch's default)."""

    cuda_devices: tuple[str, ...] | None
    threads: int | None


def plan_placements(size: int, engine_options: dict[str, Any]) -> list[Placement]:
    """The placement of each of ``size`` replicas; ValueError when the host has too few devices."""
    if size < 1:
        raise ValueError(f"data_parallel_size must be 1 or more, got {size}")
    per_replica = int(engine_options.get("tensor_parallel_size", 1) or 1)
    device = str(engine_options.get("device", "auto"))
    visible = _visible_cuda_devices() if device != "cpu" else []
    if device.startswith("cuda") and not visible:
        raise ValueError(f"data_parallel_size={size} with device={device!r}: no CUDA device is visible here")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return place_replicas(size, per_replica, visible, cpus)


def place_replicas(size: int, per_replica: int, visible: list[str], cpus: int) -> list[Placement]:
    """``size`` replicas of ``per_replica`` devices each (their tensor-parallel ranks)
    over the ``visible`` CUDA device ids, in order, without sharing one; with none
    visible, ``cpus`` threads shared among them. ValueError when too few are visible."""
    if visible:
        if size * per_replica > len(visible):
            raise ValueError(f"data_parallel_size={size} with {per_replica} device(s) per replica needs "
                             f"{size * per_replica} CUDA devices; {len(visible)} are visible "
                             f"({', '.join(visible)})")
        return [Placement(tuple(visible[i * per_replica:(i + 1) * per_replica]), None) for i in range(size)]
    return [Placement(None, max(1, cpus // size)) for _ in range(size)]


def _visible_cuda_devices() -> list[str]:
    """This process's visible CUDA devices as ids for CUDA_VISIBLE_DEVICES (none without CUDA).
    Counting them does not initialise CUDA in this process."""
    import torch

    if not torch.cuda.is_available():
        return []
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None and given.strip():
        return [device.strip() for device in given.split(",") if device.strip()][:torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


class ReplicaProcess:
    """One replica: its process, its end of the socket pair, and a reader thread that
    hands each message to ``on_message`` and, when the connection breaks, calls ``on_exit``
    with a description of how the process ended."""

    def __init__(self, index: int, model: str, engine_options: dict[str, Any], placement: Placement) -> None:
        self.index = index
        self.placement = placement
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "shardline.tasks.replica", "--model", _absolute_if_local(model),
                   "--engine-options", json.dumps(engine_options, default=str), "--fd", str(theirs.fileno()),
                   "--index", str(index)]
        env = dict(os.environ)
        if placement.cuda_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(placement.cuda_devices)
        if placement.threads is not None:
            command += ["--threads", str(placement.threads)]
            env["OMP_NUM_THREADS"] = str(placement.threads)
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self.pid = self.process.pid
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()

    def __str__(self) -> str:
        return f"data-parallel replica {self.index} (pid {self.pid})"

    def wait_ready(self, timeout: float) -> None:
        """Wait for the greeting; RunnerError naming the replica when it failed to load or exited."""
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if self.process.poll() is not None:
                raise RunnerError(f"{self} exited before serving ({self.exit_description()})")
            if time.monotonic() > deadline:
                raise RunnerError(f"{self} did not load its engine within {timeout:.0f}s")
        try:
            kind, detail = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise RunnerError(f"{self} exited before serving ({self.exit_description()})") from exc
        if kind != "ready":
            raise RunnerError(f"{self} failed to load its engine: {detail}")

    def listen(self, on_message: Callable[[ReplicaProcess, tuple[Any, ...]], None],
               on_exit: Callable[[ReplicaProcess, str], None]) -> None:
        """Start the reader thread (after ``wait_ready``)."""
        def read() -> None:
            try:
                while True:
                    on_message(self, self._conn.recv())
            except (EOFError, OSError):
                pass
            on_exit(self, self.exit_description(wait=5.0))

        threading.Thread(target=read, name=f"shardline-replica-{self.index}-reader", daemon=True).start()

    def send(self, message: tuple[Any, ...]) -> bool:
        """Send ``message``; False when the replica is gone (its reader reports how)."""
        with self._send_lock:
            try:
                self._conn.send(message)
                return True
            except OSError:
                return False

    def exit_description(self, wait: float = 0.0) -> str:
        """How the process ended ('running' when it has not), waiting up to ``wait`` seconds."""
        try:
            code = self.process.wait(timeout=wait) if wait else self.process.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return "still running, its connection closed"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    def stop(self) -> None:
        """Ask the replica to close, kill it if it has not exited within STOP_SECONDS."""
        self.send(("close",))
        try:
            self.process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not exit within %.0fs: killed", self, STOP_SECONDS)
            self.process.kill()
            self.process.wait()
        self._conn.close()


def _absolute_if_local(model: str) -> str:
    """A local model directory as an absolute path: the replica may not share the caller's cwd."""
    return str(Path(model).resolve()) if Path(model).exists() else model
