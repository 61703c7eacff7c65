"""infra/prefect.yaml deployed with Prefect's own CLI onto the test server, onto a
Kubernetes work pool created from infra/k8s-gpu-job-template.json; then the stored
parameter schemas are what the UI renders as forms."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.settings import get_current_settings
from prefect.utilities.schema_tools import validate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def deployments(prefect_harness, job_template) -> dict:
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="shardline-gpu", type="kubernetes",
                                               base_job_template=job_template), overwrite=True)
    env = {**os.environ, "PREFECT_API_URL": get_current_settings().api.url}
    done = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all",
                           "--prefect-file", "infra/prefect.yaml"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with get_client(sync_client=True) as client:
        return {name: client.read_deployment_by_name(name)
                for name in ("batch-inference/nightly", "backfill/daily-backfill")}


def _definition(schema: dict, name: str) -> dict:
    return schema["definitions"][name]


def test_deployments_carry_schedules_pool_and_valid_defaults(deployments):
    for deployment in deployments.values():
        assert deployment.work_pool_name == "shardline-gpu"
        assert [s.schedule.cron for s in deployment.schedules] in (["0 2 * * *"], ["30 3 * * *"])
        validate(deployment.parameters, deployment.parameter_openapi_schema, raise_on_error=True,
                 preprocess=True, ignore_required=False)
    assert deployments["batch-inference/nightly"].entrypoint == "shardline.flows.batch_inference:batch_inference"


def test_parameter_forms_have_descriptions_enums_and_defaults(deployments):
    schema = deployments["batch-inference/nightly"].parameter_openapi_schema
    assert list(schema["properties"]) == ["job", "execution", "reprocess_completed", "progress_interval"]
    assert schema["properties"]["progress_interval"]["default"] == 30
    assert schema["properties"]["progress_interval"].get("description")
    assert schema["required"] == ["job"]
    job = _definition(schema, "BatchJob")
    assert all(field.get("description") for field in job["properties"].values())
    assert set(job["required"]) == {"input", "output", "model"}
    assert _definition(schema, "JobTask")["enum"] == ["generate", "chat", "embed"]
    assert _definition(schema, "SamplingDefaults")["properties"]["max_tokens"]["default"] == 256
    execution = _definition(schema, "Execution")
    assert all(field.get("description") for field in execution["properties"].values())
    assert _definition(schema, "TaskRunnerKind")["enum"] == ["threads", "ray"]
    assert execution["properties"]["gpus_per_shard"]["default"] == 1.0

    schema = deployments["backfill/daily-backfill"].parameter_openapi_schema
    assert all(prop.get("description") for prop in schema["properties"].values())
    assert _definition(schema, "Reprocess")["enum"] == ["none", "failed", "completed"]
    assert schema["properties"]["reprocess"]["default"] == "none"
    assert (schema["properties"]["max_active_runs"]["minimum"], schema["properties"]["max_active_runs"]["maximum"],
            schema["properties"]["max_active_runs"]["default"]) == (1, 64, 2)
    partitions = _definition(schema, "PartitionSelection")["properties"]
    assert partitions["start"]["anyOf"][0]["format"] == "date"  # a date picker
    assert deployments["backfill/daily-backfill"].parameters["partitions"]["last_days"] == 3
