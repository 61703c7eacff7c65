"""Asking the host's shared engine service (what the operator uses by default) what it holds."""

from __future__ import annotations

from typing import Any


def service_info(model: str, engine_options: dict[str, Any]) -> dict[str, Any]:
    """pid, loads, connections, shards_run and unfinished_requests of the service for this
    configuration (started if none runs, as a task instance would)."""
    from shardline.tasks.engine_client import ServiceClient

    return ServiceClient(model, engine_options).service_info()


def requests_in_flight(model: str, engine_options: dict[str, Any], engine_service: bool) -> int:
    """Unfinished requests in the engine a ShardBatch with ``engine_service`` uses."""
    if engine_service:
        return service_info(model, engine_options)["unfinished_requests"]
    from shardline.tasks.engine_cache import get_engine

    return get_engine(model, **engine_options).llm_engine.get_num_unfinished_requests()
