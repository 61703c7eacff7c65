"""The client of the host's shared engine service: a ShardExecutor (tasks/executor.py).

The engine can run in a process of its own (tasks/engine_service.py) and serve the
shards of other processes over a Unix socket: detached, one per user, engine
configuration and GPU binding on a host. The first process that needs it starts
it; later processes connect instead of loading the model (Airflow 3 runs every
task instance in a fresh process). It retires after
``SHARDLINE_ENGINE_IDLE_TIMEOUT`` seconds (default 600) without connections.

Runtime files of a shared service live in ``SHARDLINE_RUNTIME_DIR`` (default
``/tmp/shardline-<uid>``, mode 0700, refused if another user owns it or may write
it), named by a hash of the configuration and binding: ``.sock`` (the listener),
``.key`` (a random authkey, mode 0600: only the same user can connect), ``.pid``,
``.log`` and ``.lock``. The lock (flock) lets one process at a time find, start or
retire the service; it is never removed, so every process locks the same file. A
socket nobody listens on (its service died) is stale: it is removed and a new
service started.

Protocol (multiprocessing.connection, pickled tuples, one connection per shard):
the service greets with ("ready", info); the client sends ("run", service id, rows,
report rows) and perhaps ("abort",); the reply is ("results", rows), ("aborted", message)
or ("failed", message), after ("rows", [RowDone, ...]) messages as rows finish when the
client asked for them. ("info",) is answered with ("info", info).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

from .executor import EngineReading, RowCallback, RowRequest, RowResult, RunnerError, ShardAborted, report_row

RUNTIME_DIR_ENV = "SHARDLINE_RUNTIME_DIR"
IDLE_TIMEOUT_ENV = "SHARDLINE_ENGINE_IDLE_TIMEOUT"
START_TIMEOUT_ENV = "SHARDLINE_ENGINE_START_TIMEOUT"
DEFAULT_IDLE_TIMEOUT = 600.0
DEFAULT_START_TIMEOUT = 1800.0  # a large model can take many minutes to load
GREETING_TIMEOUT = 60.0
READING_SECONDS = 5.0  # engine_reading asks the service at most this often
_SOCKET_PATH_MAX = 100  # AF_UNIX paths are limited to 107 bytes on Linux


class EngineServiceError(RuntimeError):
    """The engine service could not be started, reached or trusted."""


@dataclass(frozen=True)
class ServiceFiles:
    """The runtime files of one engine service: ``<base>.sock``, ``.key``, ``.pid``, ``.log``, ``.lock``."""

    base: Path

    @property
    def sock(self) -> Path:
        return self._with_suffix("sock")

    @property
    def key(self) -> Path:
        return self._with_suffix("key")

    @property
    def pid(self) -> Path:
        return self._with_suffix("pid")

    @property
    def log(self) -> Path:
        return self._with_suffix("log")

    @property
    def lock(self) -> Path:
        return self._with_suffix("lock")

    def _with_suffix(self, suffix: str) -> Path:
        return self.base.with_name(f"{self.base.name}.{suffix}")


@contextlib.contextmanager
def file_lock(path: Path, directory_may_be_gone: bool = False) -> Iterator[None]:
    """An exclusive flock on ``path`` (created 0600 if missing); released on exit or death.
    ``directory_may_be_gone``: when ``path``'s directory was removed, go on without the
    lock (no one can take it then, nor find the files it guards)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except FileNotFoundError:
        if not directory_may_be_gone or path.parent.exists():
            raise
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def runtime_dir() -> Path:
    """The directory of shared services' files: private to this user, created if missing."""
    path = Path(os.environ.get(RUNTIME_DIR_ENV) or Path(tempfile.gettempdir()) / f"shardline-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = path.stat()
    if status.st_uid != os.getuid() or status.st_mode & 0o022:
        raise EngineServiceError(
            f"runtime directory {path} is owned by uid {status.st_uid} with mode {oct(status.st_mode & 0o777)}; "
            f"it must belong to this user (uid {os.getuid()}) and be writable by no one else. Set "
            f"{RUNTIME_DIR_ENV} to a private directory")
    return path


def service_files(model: str, engine_options: dict[str, Any], binding: str | None,
                  data_parallel_size: int = 1) -> ServiceFiles:
    """Where the shared service of this engine configuration, replica count and GPU binding keeps its files."""
    replicas = {"data_parallel_size": data_parallel_size} if data_parallel_size > 1 else {}
    identity = json.dumps({"model": model, "options": engine_options, "binding": binding, **replicas},
                          sort_keys=True, default=str)
    files = ServiceFiles(runtime_dir() / f"engine-{hashlib.sha256(identity.encode()).hexdigest()[:20]}")
    if len(str(files.sock)) > _SOCKET_PATH_MAX:
        raise EngineServiceError(f"socket path {files.sock} is too long for a Unix socket; set {RUNTIME_DIR_ENV} "
                                 "to a shorter directory")
    return files


def _seconds_from_env(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    try:
        seconds = float(value) if value else default
    except ValueError:
        seconds = -1.0
    if seconds < 0:
        raise EngineServiceError(f"{name}={value!r} is not a number of seconds (0 or more)")
    return seconds


def _absolute_if_local(model: str) -> str:
    """A local model directory as an absolute path: the service may run elsewhere than the caller's cwd."""
    return str(Path(model).resolve()) if Path(model).exists() else model


def _service_command(model: str, engine_options: dict[str, Any], files: ServiceFiles,
                     idle_timeout: float, data_parallel_size: int = 1) -> list[str]:
    replicas = ["--data-parallel-size", str(data_parallel_size)] if data_parallel_size > 1 else []
    return [sys.executable, "-m", "shardline.tasks.engine_service", "--model", _absolute_if_local(model),
            "--engine-options", json.dumps(engine_options, default=str), "--socket", str(files.sock),
            "--authkey-file", str(files.key), "--idle-timeout", str(idle_timeout),
            "--lock-file", str(files.lock), "--owned-file", str(files.pid), *replicas]


def _write_authkey(path: Path) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as key_file:
        key_file.write(secrets.token_bytes(32))


def _log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


class ServiceClient:
    """A ShardExecutor (tasks/executor.py) over connections to the host's shared engine
    service for one configuration and GPU binding, started on first use."""

    def __init__(self, model: str, engine_options: dict[str, Any], data_parallel_size: int = 1) -> None:
        self.model = model
        self.engine_options = dict(engine_options)
        self.data_parallel_size = data_parallel_size  # engine replicas the service runs (tasks/data_parallel.py)
        self.files = service_files(model, self.engine_options, os.environ.get("CUDA_VISIBLE_DEVICES"),
                                   data_parallel_size)
        self._lock = threading.RLock()  # reentrant: abort_shard may run in a signal handler
        self._calls: dict[str, tuple[Connection, str]] = {}  # shard key -> (its connection, service id)
        self._starting: set[str] = set()  # shard keys connecting or sending their rows
        self._pending_aborts: set[str] = set()
        self._ids = itertools.count(1)
        self._closed = False
        self._reading: EngineReading | None = None  # engine_reading's last answer, and when
        self._reading_at: float | None = None

    def ensure_started(self) -> dict[str, Any]:
        """Start the service if it is not running; return its info (pid, loads, ...)."""
        conn, info = self._connect()
        conn.close()
        return info

    def service_info(self) -> dict[str, Any]:
        """The service's info now: pid, loads, connections, shards run, unfinished requests,
        and its driver's stats."""
        conn, _ = self._connect()
        with conn:
            return self._ask_info(conn, GREETING_TIMEOUT)

    @staticmethod
    def _ask_info(conn: Connection, timeout: float) -> dict[str, Any]:
        conn.send(("info",))
        if not conn.poll(timeout):
            raise EngineServiceError(f"the engine service did not answer an info request in {timeout:.0f}s")
        return conn.recv()[1]

    def run_shard(self, key: str, rows: list[RowRequest], on_row: RowCallback | None = None) -> list[RowResult]:
        """Run ``rows`` of shard ``key`` on the service; one RowResult each, in order; ``on_row``
        is told of each as it finishes (in batches, on this thread)."""
        if not rows:
            return []
        with self._lock:
            if self._closed:
                raise RunnerError("the shard runner is closed")
            self._starting.add(key)
        service_id = f"{key}@{os.getpid()}.{next(self._ids)}"
        info: dict[str, Any] = {}
        try:
            conn, info = self._connect()
            try:
                conn.send(("run", service_id, list(rows), on_row is not None))
                with self._lock:
                    self._starting.discard(key)
                    self._calls[key] = (conn, service_id)
                    if key in self._pending_aborts:
                        self._pending_aborts.discard(key)
                        self._send_abort(conn)
                kind, payload = conn.recv()
                while kind == "rows" and on_row is not None:
                    for done in payload:
                        report_row(on_row, done)
                    kind, payload = conn.recv()
            finally:
                with self._lock:
                    self._calls.pop(key, None)
                conn.close()
        except (EOFError, OSError) as exc:
            raise RunnerError(f"the engine service (pid {info.get('pid', '?')}) went away while running shard "
                              f"{key} ({type(exc).__name__}: {exc}); its log: {self.files.log}") from exc
        finally:
            with self._lock:
                self._starting.discard(key)
                self._pending_aborts.discard(key)
        if kind == "results":
            return payload
        message = payload.replace(service_id, key)
        raise ShardAborted(message) if kind == "aborted" else RunnerError(message)

    def engine_reading(self) -> EngineReading | None:
        """The service's engine load (a round trip, at most every READING_SECONDS; None when
        no service is running: this never starts one)."""
        now = time.monotonic()
        if self._reading_at is not None and now - self._reading_at < READING_SECONDS:
            return self._reading
        self._reading_at = now
        connected = self._try_connect(self.files)
        if connected is None:
            self._reading = None
        else:
            with connected[0] as conn:
                self._reading = self._ask_info(conn, GREETING_TIMEOUT).get("engine_reading")
        return self._reading

    def abort_shard(self, key: str) -> bool:
        """Ask the service to abort shard ``key``; its ``run_shard`` raises ShardAborted.
        Callable from any thread or a signal handler. Returns whether the shard was running."""
        with self._lock:
            if key in self._calls:
                self._send_abort(self._calls[key][0])
                return True
            if key in self._starting:
                self._pending_aborts.add(key)  # sent as soon as its rows are
                return True
        return False

    def abort_all(self) -> int:
        """Abort every shard this client runs on the service; return how many."""
        with self._lock:
            keys = set(self._calls) | set(self._starting)
        for key in keys:
            self.abort_shard(key)
        return len(keys)

    def close(self) -> None:
        """Refuse new shards and abort those running; the service itself lives on until idle."""
        with self._lock:
            self._closed = True
            calls = list(self._calls.values())
        for conn, _ in calls:
            self._send_abort(conn)

    @staticmethod
    def _send_abort(conn: Connection) -> None:
        try:
            conn.send(("abort",))
        except OSError:
            pass  # the connection is gone, and with it the shard (the service aborts it)

    @staticmethod
    def _try_connect(files: ServiceFiles) -> tuple[Connection, dict[str, Any]] | None:
        """A greeted connection to the service behind ``files``, or None when none listens there."""
        try:
            conn = Client(str(files.sock), family="AF_UNIX", authkey=files.key.read_bytes())
        except (FileNotFoundError, ConnectionError, EOFError):
            return None  # no listener (a stale socket), or one that died during the handshake
        try:
            if not conn.poll(GREETING_TIMEOUT):
                raise EngineServiceError(f"the engine service at {files.sock} did not answer in "
                                         f"{GREETING_TIMEOUT:.0f}s; its log: {files.log}")
            kind, info = conn.recv()
        except (EOFError, OSError):
            conn.close()
            return None  # it was retiring
        return conn, info

    @staticmethod
    def _wait_until_serving(files: ServiceFiles, process: subprocess.Popen | None, pid: int,
                            timeout: float) -> tuple[Connection, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            connected = ServiceClient._try_connect(files) if files.sock.exists() else None
            if connected is not None:
                return connected
            exited = process.poll() is not None if process is not None else not _is_engine_service(pid)
            if exited:
                raise EngineServiceError(f"the engine service (pid {pid}) exited before serving; last lines of "
                                         f"its log {files.log}:\n{_log_tail(files.log)}")
            if time.monotonic() > deadline:
                raise EngineServiceError(f"the engine service (pid {pid}) did not start serving within "
                                         f"{timeout:.0f}s ({START_TIMEOUT_ENV}); its log: {files.log}")
            time.sleep(0.05)


    def _connect(self) -> tuple[Connection, dict[str, Any]]:
        with file_lock(self.files.lock):
            connected = self._try_connect(self.files)
            if connected is not None:
                return connected
            return self._start()

    def _start(self) -> tuple[Connection, dict[str, Any]]:
        """Start the service (or wait for one a killed process started); the file lock is held."""
        files, timeout = self.files, _seconds_from_env(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT)
        try:
            pid = int(files.pid.read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and _is_engine_service(pid) and files.key.exists():
            return self._wait_until_serving(files, None, pid, timeout)  # still loading
        for stale in (files.sock, files.pid):
            stale.unlink(missing_ok=True)
        _write_authkey(files.key)
        command = _service_command(self.model, self.engine_options, files,
                                   _seconds_from_env(IDLE_TIMEOUT_ENV, DEFAULT_IDLE_TIMEOUT), self.data_parallel_size)
        with open(files.log, "ab") as log:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, close_fds=True)  # detached: outlives this process
        files.pid.write_text(str(process.pid))
        return self._wait_until_serving(files, process, process.pid, timeout)


def _is_engine_service(pid: int) -> bool:
    """Whether ``pid`` is alive and is an engine service (not a process that reused the pid)."""
    try:
        return b"shardline.tasks.engine_service" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
