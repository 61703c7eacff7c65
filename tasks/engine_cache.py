"""The per-process engine cache: one engine per engine configuration, loaded once.

This is shardline's one deliberate piece of mutable module-level state, with an
explicit close. Every shard task in a worker process asks here for the engine of
its job's configuration: the first caller loads it (under the lock, so two tasks
never load the same model twice), later callers share it through its ShardRunner,
whose single driver thread is the only code that touches the engine.

Lifetime:
- A flow run holds the cache with ``engines_held()``; when the last flow run in the
  process leaves, the engines are closed. Two flow runs in one process (a backfill's
  children, concurrent runs under a test harness) share one engine and neither
  closes it under the other. ``close_engines()`` closes everything at once.
- A runner whose driver failed (its engine cannot go on: a tensor-parallel rank died)
  is closed and dropped on the next request for its configuration, which loads anew.
- In a Ray worker process no flow run holds the cache: the engine stays loaded for
  the next shard task Ray sends there, and goes when the worker exits.

Device binding: an engine is loaded on the accelerators visible at load time
(``CUDA_VISIBLE_DEVICES``, which Ray sets per task). Ray may later hand a reused
worker another GPU. A cached engine on a GPU this task was not given is closed; if
CUDA was already initialised in this process on other devices, CUDA cannot switch,
and ``EngineBindingError`` says so instead of running on the wrong GPU.

Where the engine runs (``EngineHost``): in this process, driven by a ShardRunner
thread (``thread``, the default); or in the host's shared engine service
(``service``), a detached process that outlives this one and serves every process
of the same user with the same engine configuration (tasks/engine_client.py,
tasks/engine_service.py). Either way the pipeline gets a ShardExecutor
(tasks/executor.py). With ``data_parallel_size`` above 1, the process that runs the
engine runs that many replicas instead, each in a child process on its own device(s),
fed from one queue of rows (tasks/data_parallel.py).

Diagnostics: with ``SHARDLINE_ENGINE_EVENTS`` set to a file path, every engine load
appends one JSON line (pid, host, model, binding, loads in this process), so one can
see where engines were loaded across a cluster.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .data_parallel import DataParallelRunner
from .engine_client import ServiceClient
from .executor import ShardExecutor
from .runner import ShardRunner
from .shutdown import clear_shutdown, mark_shutdown, raise_if_shutting_down

if TYPE_CHECKING:
    from shardline import LLM

ENGINE_EVENTS_ENV = "SHARDLINE_ENGINE_EVENTS"


class EngineHost(str, enum.Enum):
    """Which process runs the engine that a process's shards go to."""

    THREAD = "thread"
    SERVICE = "service"


_LOCK = threading.Lock()
_RUNNERS: dict[str, ShardRunner] = {}  # engine key -> this process's runner of that engine
_CLIENTS: dict[str, ServiceClient] = {}  # binding and engine key -> a client of the service
_REPLICATED: dict[str, DataParallelRunner] = {}  # binding, replicas and engine key -> data-parallel runner
_BINDINGS: dict[str, str | None] = {}  # engine key -> CUDA_VISIBLE_DEVICES at load
_LOADS: dict[str, int] = {}  # engine key -> loads in this process, ever
_HOLDERS = 0  # flow runs in this process inside engines_held()
_CLOSED_REQUESTS = [0]  # engine requests added by this process's closed runners


class EngineBindingError(RuntimeError):
    """This process's CUDA context is bound to other GPUs than the ones this task was given."""


def engine_key(model: str, engine_options: dict[str, Any]) -> str:
    """The cache key of an engine configuration."""
    return json.dumps({"model": model, **engine_options}, sort_keys=True, default=str)


def accelerator_binding() -> str | None:
    """The GPUs this process may use now (``CUDA_VISIBLE_DEVICES``), None when unrestricted."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def get_executor(model: str, engine_host: EngineHost = EngineHost.THREAD, data_parallel_size: int = 1,
                 **engine_options: Any) -> ShardExecutor:
    """The ShardExecutor for ``model`` and ``engine_options`` on ``engine_host``: this
    process's own ShardRunner, or a client of the engine process the host names. With
    ``data_parallel_size`` above 1, that process runs as many engine replicas
    (tasks/data_parallel.py) fed from one row queue."""
    if EngineHost(engine_host) is EngineHost.SERVICE:
        return _get_client(model, engine_options, data_parallel_size)
    if data_parallel_size > 1:
        return _get_replicated(model, engine_options, data_parallel_size)
    return get_runner(model, **engine_options)


def _get_replicated(model: str, engine_options: dict[str, Any], size: int) -> DataParallelRunner:
    """This process's data-parallel runner of ``size`` replicas, started on first use."""
    raise_if_shutting_down(f"loading model {model}")
    key = f"{accelerator_binding()}|{size}|{engine_key(model, engine_options)}"
    with _LOCK:  # replicas load in their own processes; the lock keeps them from starting twice
        runner = _REPLICATED.get(key)
        if runner is None:
            runner = _REPLICATED[key] = DataParallelRunner(model, engine_options, size)
            _LOADS[key] = _LOADS.get(key, 0) + 1
        return runner


def get_runner(model: str, **engine_options: Any) -> ShardRunner:
    """This process's ShardRunner for ``model`` and ``engine_options``, loaded on first use."""
    raise_if_shutting_down(f"loading model {model}")  # a stopping run loads no engine
    key = engine_key(model, engine_options)
    binding = accelerator_binding()
    stale: ShardRunner | None = None
    with _LOCK:
        runner = _RUNNERS.get(key)
        if runner is not None and runner.failure is not None:  # its engine cannot go on: a retry loads anew
            stale, runner = _RUNNERS.pop(key), None
        elif runner is not None and _BINDINGS[key] != binding:
            _check_can_rebind(_BINDINGS[key], binding)
            stale, runner = _RUNNERS.pop(key), None
        if runner is None:
            if stale is not None:
                _close(stale)  # free its memory (its processes) before loading again
            runner = _load(model, engine_options, key, binding)
            _RUNNERS[key], _BINDINGS[key] = runner, binding
        return runner


def load_runner(model: str, engine_options: dict[str, Any], owner_drives: bool = False) -> ShardRunner:
    """Load an engine outside the cache, for a process that owns its one engine (the
    engine service); the load is counted and recorded as the cache's are."""
    with _LOCK:
        return _load(model, engine_options, engine_key(model, engine_options), accelerator_binding(),
                     owner_drives)


def _load(model: str, engine_options: dict[str, Any], key: str, binding: str | None,
          owner_drives: bool = False) -> ShardRunner:
    from shardline import LLM  # torch loads with the first engine only

    if owner_drives:  # the caller's thread loads and drives: one thread runs all torch work
        llm = LLM(model, **engine_options)
    else:  # the runner's driver thread will run the steps
        llm = run_on_passing_thread(lambda: LLM(model, **engine_options))
    runner = ShardRunner(llm, owner_drives=owner_drives)
    _LOADS[key] = _LOADS.get(key, 0) + 1
    _record_load(model, key, binding)
    return runner


def run_on_passing_thread(build: Callable[[], Any]) -> Any:
    """``build()`` on a thread that ends when it returns.

    Why: GNU OpenMP (torch's CPU thread pool) keeps a pool of worker threads for
    every thread that ever ran a parallel region, and once those pools hold more
    threads than there are CPUs it stops spin-waiting between regions; each of the
    thousands of parallel ops in a step then pays a futex wake-up (on 2 CPUs, steps
    about 25% slower). Loading an engine runs parallel ops, so it runs here and its
    pool ends with the thread; the runner's driver thread keeps the only busy pool.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = build()
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="shardline-engine-load")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _get_client(model: str, engine_options: dict[str, Any], data_parallel_size: int = 1) -> ServiceClient:
    """A client of the host's shared service for this configuration and this process's
    GPUs (the service is started on first use)."""
    raise_if_shutting_down(f"loading model {model}")
    key = f"{accelerator_binding()}|{data_parallel_size}|{engine_key(model, engine_options)}"
    with _LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = ServiceClient(model, engine_options, data_parallel_size)
    client.ensure_started()  # outside the lock: a first start loads the model
    return client


def get_engine(model: str, **engine_options: Any) -> LLM:
    """This process's ``LLM`` for ``model`` and ``engine_options`` (loaded on first use)."""
    return get_runner(model, **engine_options).llm


@contextlib.contextmanager
def engines_held() -> Iterator[None]:
    """Hold this process's engines for a flow run; the last holder to leave closes them."""
    global _HOLDERS
    with _LOCK:
        _HOLDERS += 1
    try:
        yield
    finally:
        with _LOCK:
            _HOLDERS -= 1
            last = _HOLDERS == 0
        if last:
            close_engines()
            clear_shutdown()  # a stopped run's engines are closed; a later run starts afresh


def request_shutdown(reason: str) -> None:
    """Stop the run: set the shutdown flag (tasks/shutdown.py: no shard starts, no engine
    loads, nothing more is written) and abort every shard on every cached engine.
    Safe in a signal handler."""
    mark_shutdown(reason)
    abort_all()


def abort_all() -> int:
    """Abort every shard running on every cached engine (their run_shard calls raise
    ShardAborted); return how many engines were asked. Safe in a signal handler: it
    takes no lock the interrupted thread might hold."""
    executors = _executors()  # a snapshot without _LOCK, which is not reentrant
    for executor in executors:
        executor.abort_all()
    return len(executors)


def close_engines() -> int:
    """Stop every runner, close every engine and empty the cache; return how many.
    (The shared service lives on until idle: only its clients close.)"""
    with _LOCK:
        executors = _executors()
        _RUNNERS.clear()
        _CLIENTS.clear()
        _REPLICATED.clear()
        _BINDINGS.clear()
    for executor in executors:
        _close(executor)
    return len(executors)


def num_cached_engines() -> int:
    with _LOCK:
        return len(_RUNNERS) + len(_CLIENTS) + len(_REPLICATED)


def _executors() -> list[ShardExecutor]:
    return [*_RUNNERS.values(), *_CLIENTS.values(), *_REPLICATED.values()]


def engine_loads() -> dict[str, int]:
    """How many times each engine configuration was loaded in this process."""
    with _LOCK:
        return dict(_LOADS)


def engine_requests() -> int:
    """Engine requests this process's own engines were given so far (retries included),
    over every engine it loaded, closed ones too: the engine work a run cost."""
    hosts: list[ShardRunner | DataParallelRunner] = [*_RUNNERS.values(), *_REPLICATED.values()]
    return _CLOSED_REQUESTS[0] + sum(host.stats()["requests_added"] for host in hosts)


def _close(executor: ShardExecutor) -> None:
    executor.close()
    if isinstance(executor, ShardRunner | DataParallelRunner):
        _CLOSED_REQUESTS[0] += executor.stats()["requests_added"]
    if isinstance(executor, ShardRunner):
        executor.llm.close()


def _check_can_rebind(loaded_on: str | None, given: str | None) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        raise EngineBindingError(
            f"this worker process initialised CUDA with CUDA_VISIBLE_DEVICES={loaded_on!r} but this task "
            f"was given {given!r}; CUDA cannot switch devices inside a process. Let the worker exit "
            f"after each task (Execution.reuse_ray_workers=false) or give each worker its own GPU"
        )


def _record_load(model: str, key: str, binding: str | None) -> None:
    path = os.environ.get(ENGINE_EVENTS_ENV)
    if not path:
        return
    event = {"event": "load", "pid": os.getpid(), "host": socket.gethostname(), "model": model,
             "binding": binding, "loads": _LOADS[key]}
    with open(path, "a", encoding="utf-8") as events:  # one short append per load: lines stay whole
        events.write(json.dumps(event) + "\n")
