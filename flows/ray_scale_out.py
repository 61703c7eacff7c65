"""Shard tasks on a Ray cluster, through prefect-ray's RayTaskRunner.

Each shard task asks Ray for ``gpus_per_shard`` GPUs when the cluster has GPUs
(one engine per GPU: Ray runs as many shard tasks at once as there are GPUs, and
sets CUDA_VISIBLE_DEVICES so each task sees only its own), else for
``cpus_per_shard`` CPUs. Ray would by default end a worker after one GPU task
(max_calls=1); shardline sets max_calls=0 so a worker keeps its engine loaded for
the next shard (tasks/engine_cache.py). prefect-ray is imported only when used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .execution import Execution


class RayUnavailable(RuntimeError):
    """task_runner=ray was asked for but prefect-ray / ray is not installed."""


def shard_remote_options(execution: Execution, cluster_resources: Mapping[str, float]) -> dict[str, Any]:
    """The ``ray.remote`` options of one shard task on a cluster with ``cluster_resources``."""
    max_calls = 0 if execution.reuse_ray_workers else 1
    if cluster_resources.get("GPU", 0) > 0:
        return {"num_gpus": execution.gpus_per_shard, "max_calls": max_calls}
    return {"num_cpus": execution.cpus_per_shard, "max_calls": max_calls}


@contextlib.contextmanager
def ray_submitter(execution: Execution) -> Iterator[Callable[[Any, dict[str, Any]], Any]]:
    """Enter a RayTaskRunner; yield ``submit(task, parameters) -> PrefectFuture`` onto it."""
    try:
        import ray
        from prefect_ray.context import remote_options
        from prefect_ray.task_runners import RayTaskRunner
    except ImportError as exc:
        raise RayUnavailable(f"task_runner=ray needs prefect-ray and ray: pip install 'shardline[ray]' ({exc})") \
            from exc
    with RayTaskRunner(address=execution.ray_address) as runner:
        options = shard_remote_options(execution, ray.cluster_resources())

        def submit(task: Any, parameters: dict[str, Any]) -> Any:
            with remote_options(**options):
                return runner.submit(task, parameters)

        yield submit
