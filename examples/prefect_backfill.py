"""A Prefect deployment of the backfill flow, served from this script, and a backfill over
three date partitions run through it, then run again (every partition skipped).

    python examples/prefect_backfill.py [--model Qwen/Qwen3-0.6B]

The deployment is built in code (``backfill.to_deployment``) with the same entrypoint and
parameter shape as ``daily-backfill`` in infra/prefect.yaml, over local files. A served
deployment runs each flow run in a child process that reports to the API, so the script
needs an API that outlives one flow call: the one PREFECT_API_URL names (runs then show in
its UI), or else a temporary local server that lives as long as the script.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _tiny import model_argument, resolve_model
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import arun_deployment
from prefect.deployments.runner import RunnerDeployment
from prefect.runner import Runner
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.types.entrypoint import EntrypointType

from shardline.flows.backfill import backfill
from shardline.tasks.job import BatchJob
from shardline.tasks.partitions import partition_job, read_run_record
from shardline.tasks.sample_data import write_sample_dataset

DEPLOYMENT = "backfill/example-backfill"
FIRST_DAY, DAYS = dt.date(2025, 1, 1), 3
TEMPLATE = "date={date:%Y-%m-%d}"


@contextmanager
def prefect_api() -> Iterator[str]:
    """The API to serve and run against: PREFECT_API_URL's, or a temporary local server (Prefect's
    own ephemeral server, started once here instead of per flow call; its start waits up to
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)."""
    if PREFECT_API_URL.value():
        yield PREFECT_API_URL.value()
        return
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # as `shardline`: no usage report
    server = SubprocessASGIServer()
    server.start()
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            yield server.api_url
    finally:
        server.stop()


def write_partitions(root: Path) -> None:
    """Two prompt shards in each of the date partitions ``prompts/date=YYYY-MM-DD``."""
    for day in range(DAYS):
        partition = TEMPLATE.format(date=FIRST_DAY + dt.timedelta(days=day))
        write_sample_dataset(str(root / "prompts" / partition), num_shards=2, rows_per_shard=4,
                             with_bad_rows=False)


def build_deployment(job: BatchJob) -> RunnerDeployment:
    """The backfill flow as a deployment whose default parameters cover the three partitions."""
    return backfill.to_deployment(
        name="example-backfill", entrypoint_type=EntrypointType.MODULE_PATH, tags=["shardline", "example"],
        parameters={"job": job.public_fields(),
                    "partitions": {"start": FIRST_DAY.isoformat(),
                                   "end": (FIRST_DAY + dt.timedelta(days=DAYS - 1)).isoformat(),
                                   "template": TEMPLATE},
                    "reprocess": "failed", "max_active_runs": 1})


async def serve_and_run(deployment: RunnerDeployment, runs: int) -> list[tuple[FlowRun, list[dict[str, Any]]]]:
    """Serve ``deployment`` and run it ``runs`` times, one after another; each finished flow
    run with its plan (the ``backfill-plan`` table artifact the UI shows)."""
    runner = Runner(name="shardline-example", query_seconds=1, limit=1, pause_on_shutdown=False)
    await runner.aadd_deployment(deployment)
    serving = asyncio.create_task(runner.start())
    try:
        finished = []
        for _ in range(runs):
            flow_run = await arun_deployment(DEPLOYMENT, timeout=None, poll_interval=1, as_subflow=False)
            while not runner.has_slots_available():  # its process is still exiting; stopping would cancel it
                await asyncio.sleep(0.2)
            finished.append((flow_run, await backfill_plan(flow_run)))
        return finished
    finally:
        await runner.astop()
        await serving


async def backfill_plan(flow_run: FlowRun) -> list[dict[str, Any]]:
    """The rows of the plan table the backfill run published as an artifact."""
    async with get_client() as client:
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["backfill-plan"])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    return json.loads(artifacts[0].data) if artifacts else []


def report(job: BatchJob, flow_run: FlowRun, plan: list[dict[str, Any]]) -> None:
    """The flow run's final state, its plan, and each partition's run record and outputs."""
    print(f"flow run {flow_run.name}: {flow_run.state.name if flow_run.state else 'unknown'}")
    for row in plan:
        part = partition_job(job, row["partition"])
        record = read_run_record(job, row["partition"]) or {}
        outputs = sorted(path.name for path in Path(part.output).glob("*.parquet"))
        print(f"  {row['partition']}: {row['action']} ({row['reason']}); last run {record.get('state')}, "
              f"outputs {outputs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_argument(parser)
    args = parser.parse_args()
    root = Path(args.workdir).resolve() / "backfill"
    write_partitions(root)
    job = BatchJob(input=str(root / "prompts"), output=str(root / "completions"), model=resolve_model(args),
                   sampling={"max_tokens": 8, "temperature": 0}, engine_options={"max_num_seqs": 16})
    with prefect_api() as api_url:
        print(f"Prefect API: {api_url}; deployment {DEPLOYMENT}")
        runs = asyncio.run(serve_and_run(build_deployment(job), runs=2))
    for flow_run, plan in runs:  # the second run finds every partition completed and runs none
        report(job, flow_run, plan)
    summary = json.loads((root / "completions" / "date=2025-01-01" / "_batch.json").read_text())
    print("date=2025-01-01 request counts:", summary["request_counts"])


if __name__ == "__main__":
    main()
