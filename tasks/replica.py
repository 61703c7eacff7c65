"""One data-parallel replica: a process that owns one engine and runs the row batches
its parent (tasks/data_parallel.py) sends it.

Started by the parent as ``python -m shardline.tasks.replica`` (a clean interpreter,
never a fork of a process whose torch threads are running), with one end of a socket
pair as ``--fd``, its devices in ``CUDA_VISIBLE_DEVICES`` and, on CPU, its share of
the host's threads. It loads the engine, greets with ("ready", pid), and runs every
batch through one ShardRunner whose driver loop has this process's main thread, so
the batches in flight here share one continuous batch.

Protocol (multiprocessing.connection, pickled tuples):
- parent -> replica: ("batch", batch id, rows), ("abort", batch id), ("close",);
- replica -> parent: ("ready", pid) or ("load_failed", message) once; then per batch
  ("rows", batch id, [RowDone, ...]) as rows finish, and last ("done", batch id,
  results), ("aborted", batch id) or ("failed", batch id, message); with every
  reply, the replica's ("reading", EngineReading, driver stats) when it changed.

Invariants:
- Only the reader thread receives and only under ``_send_lock`` does anyone send.
- The connection breaking (the parent died or closed it) stops this process: every
  batch is aborted and the driver returns; a replica never runs on for nobody.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import threading
from multiprocessing.connection import Connection
from typing import Any

from . import engine_cache
from .executor import RowDone, RowRequest, ShardAborted
from .runner import ShardRunner

logger = logging.getLogger("shardline.tasks.replica")


class ReplicaServer:
    """Runs the parent's row batches through one ShardRunner until closed."""

    def __init__(self, runner: ShardRunner, conn: Connection) -> None:
        self.runner = runner
        self._conn = conn
        self._send_lock = threading.Lock()

    def serve(self) -> None:
        """Greet, read requests on a thread of their own, drive the engine on this one."""
        self.send(("ready", os.getpid()))
        threading.Thread(target=self._read, name="shardline-replica-reader", daemon=True).start()
        self.runner.drive()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except OSError:
                pass  # the parent is gone: the reader sees the broken connection and stops us

    def _read(self) -> None:
        try:
            while True:
                request = self._conn.recv()
                if request[0] == "batch":
                    threading.Thread(target=self._run_batch, args=(request[1], request[2]), daemon=True,
                                     name="shardline-replica-batch").start()
                elif request[0] == "abort":
                    self.runner.abort_shard(request[1])
                elif request[0] == "close":
                    break
        except (EOFError, OSError):
            logger.warning("the parent closed the connection: aborting every batch and exiting")
            self.runner.abort_all()
        self.runner.close()  # the main thread's drive() returns

    def _run_batch(self, batch_id: str, rows: list[RowRequest]) -> None:
        reports = _RowReports(self, batch_id)
        try:
            results = self.runner.run_shard(batch_id, rows, reports.add)
            reply: tuple[Any, ...] = ("done", batch_id, results)
        except ShardAborted:
            reply = ("aborted", batch_id)
        except Exception as exc:
            reply = ("failed", batch_id, f"{type(exc).__name__}: {exc}")
        reports.flush()
        self.send(("reading", self.runner.engine_reading(), self.runner.stats()))
        self.send(reply)


class _RowReports:
    """A batch's finished rows, sent to the parent a few at a time (after each step at most)."""

    def __init__(self, server: ReplicaServer, batch_id: str) -> None:
        self._server = server
        self._batch_id = batch_id
        self._rows: list[RowDone] = []

    def add(self, done: RowDone) -> None:  # the driver thread: a send of a small message
        self._rows.append(done)
        if len(self._rows) >= 8:
            self.flush()

    def flush(self) -> None:
        rows, self._rows = self._rows, []
        if rows:
            self._server.send(("rows", self._batch_id, rows))


def _apply_thread_share(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a data-parallel engine replica (started by shardline itself)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine-options", default="{}", help="JSON object of engine options")
    parser.add_argument("--fd", required=True, type=int, help="this end of the socket pair to the parent")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for this replica's torch")
    parser.add_argument("--index", type=int, default=0, help="this replica's index, for its log lines")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s replica {args.index} %(name)s %(levelname)s "
                        "%(message)s")
    conn = Connection(args.fd)
    try:
        _apply_thread_share(args.threads)
        runner = engine_cache.load_runner(args.model, json.loads(args.engine_options), owner_drives=True)
    except Exception as exc:
        logger.exception("the engine did not load")
        conn.send(("load_failed", f"{type(exc).__name__}: {exc}"))
        return
    try:
        ReplicaServer(runner, conn).serve()
    finally:
        runner.llm.close()
    gc.freeze()  # exit without walking torch's and the model's objects (as the engine service does)


if __name__ == "__main__":
    main()
