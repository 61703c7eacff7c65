"""Where and how a run's shard tasks execute: a pydantic parameter of the flows.

``Execution`` picks the task runner for shard tasks (this process's threads, or a
Ray cluster through prefect-ray's RayTaskRunner), what each shard task asks Ray
for, which process runs the engine, and the Prefect global concurrency limit that
caps shard tasks holding a GPU across all runs. It is a flow parameter, so deployments and the UI form set it.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field

from shardline.tasks.engine_cache import EngineHost


class TaskRunnerKind(str, enum.Enum):
    """Where shard tasks run."""

    THREADS = "threads"
    RAY = "ray"


class Execution(BaseModel):
    """How the shard tasks of a run execute (task runner, Ray resources, GPU slots)."""

    # Frozen: one default instance is shared by every flow call as its parameter default.
    model_config = ConfigDict(extra="forbid", frozen=True)

    task_runner: TaskRunnerKind = Field(
        default=TaskRunnerKind.THREADS,
        description="threads: shard tasks run in the flow's process and share its engine; "
        "ray: each shard task runs in a Ray worker process, which keeps its engine loaded between tasks.",
    )
    ray_address: str | None = Field(
        default=None,
        description="Ray cluster for task_runner=ray (e.g. ray://head:10001, or auto for this machine's "
        "cluster); empty uses the Ray instance already initialised in the process, else starts a local one.",
    )
    gpus_per_shard: float = Field(
        default=1.0, gt=0,
        description="GPUs each shard task asks Ray for when the cluster has GPUs (1 = one engine per GPU).",
    )
    cpus_per_shard: float = Field(
        default=1.0, gt=0, description="CPUs each shard task asks Ray for when the cluster has no GPUs.",
    )
    reuse_ray_workers: bool = Field(
        default=True,
        description="Let a Ray worker run many shard tasks, keeping its engine loaded (Ray's max_calls=0); "
        "off, each worker exits after one shard (max_calls=1).",
    )
    engine_host: EngineHost = Field(
        default=EngineHost.THREAD,
        description="Which process runs the engine of a flow process (or Ray worker): thread: that process, "
        "driven by a thread beside Prefect's; service: the host's shared engine service, which outlives the "
        "run and serves every process of the user with this engine configuration.",
    )
    gpu_concurrency_limit: str | None = Field(
        default=None,
        description="Name of a Prefect global concurrency limit; each shard task holds one slot while it "
        "runs on an engine, across every run. Create it first: prefect gcl create NAME --limit N.",
    )
