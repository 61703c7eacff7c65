"""The per-process engine cache: one engine per engine configuration, loaded once.

This is shardline's one deliberate piece of mutable module-level state (STYLE.md,
rule 5). Every shard task in a worker process asks here for the engine of its job's
configuration: the first caller loads it (under the lock, so two tasks never load
the same model twice), later callers share it through its ShardRunner, whose single
driver thread is the only code that touches the engine. ``close_engines()`` stops
the runners and frees the engines; the batch_inference flow calls it when it ends.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from .runner import ShardRunner

_LOCK = threading.Lock()
_RUNNERS: dict[str, ShardRunner] = {}


def engine_key(model: str, engine_options: dict[str, Any]) -> str:
    """The cache key of an engine configuration."""
    return json.dumps({"model": model, **engine_options}, sort_keys=True, default=str)


def get_runner(model: str, **engine_options: Any) -> ShardRunner:
    """The ShardRunner of this process's engine for ``model`` and ``engine_options``."""
    key = engine_key(model, engine_options)
    with _LOCK:
        runner = _RUNNERS.get(key)
        if runner is None:
            from shardline.engine.llm import LLM  # torch loads with the first engine only

            runner = ShardRunner(LLM(model, **engine_options))
            _RUNNERS[key] = runner
        return runner


def get_engine(model: str, **engine_options: Any) -> Any:
    """This process's ``LLM`` for ``model`` and ``engine_options`` (loaded on first use)."""
    return get_runner(model, **engine_options).llm


def close_engines() -> int:
    """Stop every runner, close every engine and empty the cache; return how many."""
    with _LOCK:
        runners = list(_RUNNERS.values())
        _RUNNERS.clear()
    for runner in runners:
        runner.close()
        runner.llm.close()
    return len(runners)


def num_cached_engines() -> int:
    with _LOCK:
        return len(_RUNNERS)
