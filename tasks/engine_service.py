"""The engine service: one process that owns one engine and runs shards for others.
(With ``--data-parallel-size`` above 1 it owns that many engine replicas instead,
child processes fed from one row queue: tasks/data_parallel.py.)

Started by tasks/engine_client.py as ``python -m shardline.tasks.engine_service``, a
clean interpreter (never a fork of a process whose torch threads are running). It
loads the engine, listens on a Unix socket (multiprocessing.connection, AF_UNIX,
authkey), and runs every shard it is sent through one ShardRunner, so shards from
many processes share one continuous batch. The ShardRunner's driver loop runs on
this process's main thread; connections are served by their own threads.

Invariants:
- One connection runs at most one shard at a time. Its service id is unique on the
  service (the client appends its pid and a counter to the shard key), so two
  processes' shards with the same key never share request ids.
- A connection that breaks while its shard runs (the client was killed) aborts that
  shard's requests; they never run on for nobody.
- Retiring (idle timeout) happens under the runtime directory's file lock, which a
  client holds from connecting until the service has counted its connection: a
  service either counts a client's connection or has removed its socket first.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from . import engine_cache
from .data_parallel import DataParallelRunner
from .engine_client import file_lock
from .executor import RowDone, ShardAborted
from .runner import ShardRunner

logger = logging.getLogger("shardline.tasks.engine_service")

ABORT_POLL_SECONDS = 0.2  # how soon a finished shard's hang-up watcher notices
ROW_REPORT_SECONDS = 0.5  # how often a shard's finished rows are sent to its client


class EngineService:
    """Serves one ShardRunner over a Unix socket until it retires."""

    def __init__(self, runner: ShardRunner | DataParallelRunner, socket_path: Path, authkey: bytes, idle_timeout: float,
                 lock_path: Path, owned_files: list[Path]) -> None:
        self.runner = runner
        self.socket_path = socket_path
        self.idle_timeout = idle_timeout  # 0: never retire when idle
        self.lock_path = lock_path
        self.owned_files = owned_files  # removed on retiring
        self._listener = Listener(str(socket_path), family="AF_UNIX", authkey=authkey)
        os.chmod(socket_path, 0o600)
        self._state = threading.Lock()
        self._connections = 0
        self._idle_since = time.monotonic()
        self._shards_run = 0
        self._retiring = False

    def serve(self) -> None:
        """Accept connections and drive the engine (on this thread) until retiring."""
        threading.Thread(target=self._accept, name="shardline-service-accept", daemon=True).start()
        if self.idle_timeout > 0:
            threading.Thread(target=self._retire_when_idle, name="shardline-service-idle", daemon=True).start()
        logger.info("engine service pid %d listening on %s (idle timeout %ss)", os.getpid(),
                    self.socket_path, self.idle_timeout or "none")
        self.runner.drive()

    def info(self) -> dict[str, Any]:
        """What a client may ask: who serves, how often it loaded, what runs now."""
        with self._state:
            connections, shards_run = self._connections, self._shards_run
        return {"pid": os.getpid(), "loads": sum(engine_cache.engine_loads().values()),
                "connections": connections, "shards_run": shards_run,
                "unfinished_requests": self.runner.unfinished_requests(),
                "engine_reading": self.runner.engine_reading(),
                "driver": self.runner.stats()}

    # ------------------------------------------------------------- connections
    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError as exc:  # AuthenticationError included: a wrong key is refused
                with self._state:
                    if self._retiring:
                        return
                logger.warning("refused a connection: %s: %s", type(exc).__name__, exc)
                continue
            with self._state:
                if self._retiring:
                    conn.close()
                    continue
                self._connections += 1
            threading.Thread(target=self._serve_connection, args=(conn,), daemon=True,
                             name="shardline-service-connection").start()

    def _serve_connection(self, conn: Connection) -> None:
        try:
            conn.send(("ready", self.info()))
            while True:
                request = conn.recv()
                if request[0] == "run":  # ("run", service id, rows[, report rows as they finish])
                    self._run_shard(conn, request[1], request[2], len(request) > 3 and bool(request[3]))
                elif request[0] == "info":
                    conn.send(("info", self.info()))
                # ("abort",) after its shard finished: nothing left to abort
        except (EOFError, OSError):
            pass  # the client closed the connection or went away
        finally:
            conn.close()
            with self._state:
                self._connections -= 1
                if self._connections == 0:
                    self._idle_since = time.monotonic()

    def _run_shard(self, conn: Connection, service_id: str, rows: list[Any], report_rows: bool) -> None:
        done = threading.Event()
        reports = _RowReports(conn) if report_rows else None
        watcher = threading.Thread(target=self._abort_on_request_or_hang_up, args=(conn, service_id, done),
                                   daemon=True, name="shardline-service-watch")
        watcher.start()
        try:
            reply: tuple[str, Any] = ("results", self.runner.run_shard(service_id, rows,
                                                                       reports.add if reports else None))
        except ShardAborted as exc:
            reply = ("aborted", str(exc))
        except Exception as exc:
            reply = ("failed", str(exc))
        finally:
            done.set()
            with self._state:
                self._shards_run += 1
        watcher.join()  # the watcher reads the connection: it must stop before the next recv
        if reports is not None:
            reports.stop()  # the last rows go before the reply
        conn.send(reply)

    def _abort_on_request_or_hang_up(self, conn: Connection, service_id: str, done: threading.Event) -> None:
        """Abort the shard when its client sends ("abort",) or its connection breaks."""
        while not done.is_set():
            try:
                if not conn.poll(ABORT_POLL_SECONDS):
                    continue
                conn.recv()  # ("abort",): nothing else is sent while a shard runs
                gone = False
            except (EOFError, OSError):
                gone = True
            if not done.is_set() and self.runner.abort_shard(service_id):
                logger.warning("shard %s aborted: %s", service_id,
                               "its client went away" if gone else "its client asked")
            if gone:
                return

    # ---------------------------------------------------------------- retiring
    def _retire_when_idle(self) -> None:
        while True:
            time.sleep(min(1.0, self.idle_timeout / 4))
            if self._retire(only_if_idle=True):
                return

    def retire(self) -> None:
        """Retire now: running shards fail, files are removed, the process exits."""
        self._retire(only_if_idle=False)

    def _retire(self, only_if_idle: bool) -> bool:
        """Remove the socket and key (so no client finds this service), then stop the driver."""
        # The runtime directory may have been removed under a running service (a cleaned-up
        # temporary directory): it must retire all the same, or it would run on for nobody.
        with file_lock(self.lock_path, directory_may_be_gone=True):
            with self._state:
                idle_for = time.monotonic() - self._idle_since if self._connections == 0 else 0.0
                if only_if_idle and idle_for < self.idle_timeout:
                    return False
                self._retiring = True
            with contextlib.suppress(FileNotFoundError):  # its socket file is gone with the directory
                self._listener.close()  # removes the socket file
            for path in self.owned_files:
                path.unlink(missing_ok=True)
        logger.info("engine service pid %d retiring (%s); driver %s", os.getpid(),
                    f"idle for {idle_for:.0f}s" if only_if_idle else "asked to stop", self.runner.stats())
        self.runner.close()  # the main thread's drive() returns
        return True


class _RowReports:
    """A shard's finished rows, collected on the driver thread and sent to its client as
    ("rows", [RowDone, ...]) every ROW_REPORT_SECONDS by a thread of their own, so a slow
    client never holds up the engine."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._rows: list[RowDone] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._send_until_stopped, daemon=True, name="shardline-service-rows")
        self._thread.start()

    def add(self, done: RowDone) -> None:
        with self._lock:
            self._rows.append(done)

    def stop(self) -> None:
        """Stop the sender and send what is left."""
        self._stopped.set()
        self._thread.join()
        self._send()

    def _send_until_stopped(self) -> None:
        while not self._stopped.wait(ROW_REPORT_SECONDS):
            self._send()

    def _send(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        if rows:
            try:
                self._conn.send(("rows", rows))
            except OSError:
                pass  # the client went away; its shard is aborted by the watcher


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="shardline's engine service (started by shardline itself)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine-options", default="{}", help="JSON object of engine options")
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--authkey-file", required=True, type=Path)
    parser.add_argument("--lock-file", required=True, type=Path, help="flock taken while retiring")
    parser.add_argument("--owned-file", type=Path, action="append", default=[], help="removed on retiring")
    parser.add_argument("--idle-timeout", type=float, default=0.0, help="seconds without connections; 0: never")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas (tasks/data_parallel.py)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    retire_now = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: retire_now.set())
    authkey = args.authkey_file.read_bytes()
    options = json.loads(args.engine_options)
    runner: ShardRunner | DataParallelRunner = (
        DataParallelRunner(args.model, options, args.data_parallel_size, owner_drives=True)
        if args.data_parallel_size > 1 else engine_cache.load_runner(args.model, options, owner_drives=True))
    service = EngineService(runner, args.socket, authkey, args.idle_timeout, args.lock_file,
                            [args.authkey_file, *args.owned_file])
    # SIGTERM retires the service cleanly (its files removed, running shards failed)
    threading.Thread(target=lambda: retire_now.wait() and service.retire(), daemon=True,
                     name="shardline-service-sigterm").start()
    try:
        service.serve()
    finally:
        if isinstance(runner, ShardRunner):
            runner.llm.close()
        else:
            runner.close()  # stops its replicas
    logger.info("engine service pid %d exited", os.getpid())
    # The interpreter's last garbage collections would walk every object of torch,
    # transformers and the model, delaying the exit a stopping host waits for; nothing
    # needs them collected now. Exit handlers still run.
    gc.freeze()


if __name__ == "__main__":
    main()
