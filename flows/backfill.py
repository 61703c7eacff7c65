"""The backfill flow: batch_inference over dataset partitions, one child flow run each.

Plan, then run. Planning reads each partition's state from storage (manifests and
run records, tasks/partitions.py) and decides by ``reprocess`` (Airflow 3 semantics)
what runs; ``dry_run`` stops there and returns the plan with reasons. Running keeps
at most ``max_active_runs`` child runs in flight, oldest partition first unless
``newest_first``. A child is batch_inference as a subflow, or a run of the named
deployment (``run_deployment``) so the partition runs on that deployment's work pool.
Rerunning a backfill is idempotent: completed partitions are skipped, and inside a
partition every shard with a matching manifest is skipped.
"""

from __future__ import annotations

import collections
import datetime as dt
from typing import Annotated, Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run
from pydantic import Field

from shardline.tasks.job import BatchJob
from shardline.tasks.partitions import (
    PartitionPlan,
    PartitionSelection,
    Reprocess,
    partition_job,
    plan_partition,
    write_run_record,
)
from shardline.tasks.summary import ShardsFailed

from .batch_inference import batch_inference
from .execution import Execution


class BackfillFailed(RuntimeError):
    """Some partitions failed; ``result`` holds every partition's outcome."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result

    def __reduce__(self) -> tuple[Any, ...]:
        return (BackfillFailed, (self.args[0], self.result))


class DeploymentParameterError(ValueError):
    """A backfill through a deployment cannot carry storage credentials in its parameters."""


@flow(name="backfill", description="Run batch inference over dataset partitions (e.g. dates): plan by "
      "reprocess behaviour, then one child flow run per partition, a few at a time.")
def backfill(
    job: BatchJob,
    partitions: PartitionSelection,
    reprocess: Reprocess = Reprocess.NONE,
    max_active_runs: Annotated[int, Field(ge=1, le=64)] = 2,
    newest_first: bool = False,
    dry_run: bool = False,
    deployment: str | None = None,
    execution: Execution = Execution(),
) -> dict[str, Any]:
    """Backfill ``job`` over ``partitions``; return the plan and each partition's outcome.

    Args:
        job: the batch job; its input and output are the partitions' parent prefixes.
        partitions: a date range (start, end, template), the last N days before the scheduled date,
            or explicit partition names.
        reprocess: none runs only never-run partitions; failed also failed or incomplete ones;
            completed reruns every partition, done shards included.
        max_active_runs: most partition runs in flight at once.
        newest_first: run the newest partitions (by name) first.
        dry_run: only list what would run and why; run nothing.
        deployment: run each partition as a run of this deployment ("batch-inference/NAME") on its
            work pool, instead of a subflow here.
        execution: where each partition's shard tasks run (threads or Ray) and the GPU concurrency limit.
    """
    logger = get_run_logger()
    if deployment and job.storage():
        raise DeploymentParameterError(
            "job.storage_options cannot travel to deployment runs (Prefect masks secret parameters); "
            "give the work pool its storage credentials (environment or Kubernetes secret) and leave "
            "storage_options empty"
        )
    names = partitions.partitions(newest_first, today=_scheduled_date())
    plans = [f.result() for f in [plan_partition_task.submit(job, name, reprocess) for name in names]]
    for plan in plans:
        logger.info("partition %s: %s (%s)", plan.partition, "run" if plan.run else "skip", plan.reason)
    create_table_artifact(table=[plan.as_row() for plan in plans], key="backfill-plan",
                          description=f"Backfill plan, reprocess={Reprocess(reprocess).value}")
    if dry_run:
        return {"dry_run": True, "partitions": [plan.as_row() for plan in plans]}
    outcomes = _run_partitions([p for p in plans if p.run], job, execution, reprocess, deployment, max_active_runs)
    result = _result(plans, outcomes)
    failed = [row["partition"] for row in result["partitions"] if row.get("state") == "failed"]
    if failed:
        raise BackfillFailed(f"{len(failed)} of {len(plans)} partition(s) failed: {', '.join(failed)}", result)
    return result


@task(name="plan-partition", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[2, 10],
      task_run_name="plan-{partition}")
def plan_partition_task(job: BatchJob, partition: str, reprocess: Reprocess) -> PartitionPlan:
    return plan_partition(job, partition, reprocess)


@task(name="run-partition", cache_policy=NO_CACHE, task_run_name="partition-{partition}")
def run_partition_task(job: BatchJob, partition: str, execution: Execution, reprocess: Reprocess,
                       deployment: str | None) -> dict[str, Any]:
    """One child flow run over ``partition``, framed by run records; its outcome."""
    write_run_record(job, partition, "running")
    part = partition_job(job, partition)
    redo = Reprocess(reprocess) == Reprocess.COMPLETED
    run_name = f"batch-inference-{partition.replace('/', '-')}"
    if deployment:
        flow_run = run_deployment(deployment, flow_run_name=run_name, timeout=None, parameters={
            "job": part.public_fields(), "execution": execution.model_dump(mode="json"),
            "reprocess_completed": redo})
        # Prefect dispatches on the caller: from a sync task it waits and returns the run,
        # which timeout=None leaves in a final state.
        assert isinstance(flow_run, FlowRun), f"run_deployment returned {flow_run!r}, not a flow run"
        state, flow_run_id = flow_run.state, flow_run.id
        assert state is not None, f"flow run {flow_run_id} of {deployment} finished without a state"
        outcome = {"state": "completed" if state.is_completed() else "failed",
                   "message": None if state.is_completed() else f"{state.type.value}: {state.message}"}
    else:
        state = batch_inference.with_options(flow_run_name=run_name)(part, execution, redo, return_state=True)
        flow_run_id = state.state_details.flow_run_id
        outcome = _subflow_outcome(state.result(raise_on_failure=False))
    write_run_record(job, partition, outcome["state"], flow_run_id=str(flow_run_id))
    return {"partition": partition, "flow_run_id": str(flow_run_id), **outcome}


def _scheduled_date() -> dt.date:
    """The day this run was scheduled for (today for an ad-hoc run), in UTC."""
    scheduled = flow_run.scheduled_start_time
    return scheduled.astimezone(dt.timezone.utc).date() if scheduled else dt.datetime.now(dt.timezone.utc).date()


def _subflow_outcome(result: Any) -> dict[str, Any]:
    if isinstance(result, ShardsFailed):
        return {"state": "failed", "message": str(result), "totals": result.summary["totals"]}
    if isinstance(result, BaseException):
        return {"state": "failed", "message": f"{type(result).__name__}: {result}"}
    return {"state": "completed", "message": None, "totals": result["totals"]}


def _run_partitions(plans: list[PartitionPlan], job: BatchJob, execution: Execution, reprocess: Reprocess,
                    deployment: str | None, max_active_runs: int) -> dict[str, dict[str, Any]]:
    """Run the planned partitions in order, at most ``max_active_runs`` at once."""
    logger = get_run_logger()
    waiting = collections.deque(plan.partition for plan in plans)
    running: dict[int, tuple[PrefectFuture, str]] = {}
    outcomes: dict[str, dict[str, Any]] = {}
    while waiting or running:
        while waiting and len(running) < max_active_runs:
            partition = waiting.popleft()
            future = run_partition_task.submit(job, partition, execution, reprocess, deployment)
            running[id(future)] = (future, partition)
        finished = next(as_completed([future for future, _ in running.values()]))
        future, partition = running.pop(id(finished))
        try:
            outcomes[partition] = future.result()
        except Exception as exc:  # the child could not even start; the record says "running"
            outcomes[partition] = {"partition": partition, "state": "failed",
                                   "message": f"{type(exc).__name__}: {exc}"}
        logger.info("partition %s %s", partition, outcomes[partition]["state"])
    return outcomes


def _result(plans: list[PartitionPlan], outcomes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows = [{**plan.as_row(), **outcomes.get(plan.partition, {"state": "skipped"})} for plan in plans]
    totals = collections.Counter(row["state"] for row in rows)
    return {"dry_run": False, "partitions": rows, "totals": dict(totals)}
