"""Reading back what a flow run left in Prefect: its logs and artifacts."""

from __future__ import annotations

import json
from typing import Any

import pyarrow.parquet as pq
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogHandler


def flow_run_record(flow_run_id: Any) -> dict[str, Any]:
    """Logs, artifacts and parameters Prefect stored for one flow run."""
    APILogHandler().flush()  # logs reach the API in batches from a background worker
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
        flow_run = client.read_flow_run(flow_run_id)
    return {
        "logs": [log.message for log in logs],
        "artifacts": {artifact.key: artifact for artifact in artifacts},
        "parameters": flow_run.parameters,
    }


def everything_as_text(record: dict[str, Any]) -> str:
    parts = list(record["logs"]) + [json.dumps(record["parameters"], default=str)]
    parts += [json.dumps({"data": a.data, "description": a.description}, default=str)
              for a in record["artifacts"].values()]
    return "\n".join(parts)


def output_ids(path) -> list[str]:
    return pq.read_table(path, columns=["id"]).column("id").to_pylist()
