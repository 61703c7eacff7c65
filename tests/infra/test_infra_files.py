"""prefect.yaml, the Kubernetes base job template, the Dockerfile and the start scripts,
validated with Prefect's own loaders and schemas (no deployment server needed here)."""

from __future__ import annotations

import re
import subprocess

import pytest
from prefect.client.schemas.schedules import CronSchedule
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools import validate
from prefect.utilities.templating import apply_values, find_placeholders

from .conftest import INFRA

FLOWS = {"shardline.flows.batch_inference:batch_inference": "batch-inference",
         "shardline.flows.backfill:backfill": "backfill"}


def test_every_deployment_loads_its_flow_and_its_parameters_validate(prefect_yaml):
    deployments = {d["name"]: d for d in prefect_yaml["deployments"]}
    assert set(deployments) == {"nightly", "daily-backfill"}
    for deployment in deployments.values():
        flow = load_flow_from_entrypoint(deployment["entrypoint"], use_placeholder_flow=False)
        assert flow.name == FLOWS[deployment["entrypoint"]]
        schema = parameter_schema(flow).model_dump_for_openapi()
        validate(deployment["parameters"], schema, raise_on_error=True, preprocess=True, ignore_required=False)
        flow.validate_parameters(deployment["parameters"])  # what Prefect does when a run starts
        assert deployment["work_pool"]["name"] == "shardline-gpu"
        for schedule in deployment["schedules"]:
            CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])


def test_bad_default_parameters_would_be_caught(prefect_yaml):
    deployment = prefect_yaml["deployments"][1]
    flow = load_flow_from_entrypoint(deployment["entrypoint"], use_placeholder_flow=False)
    schema = parameter_schema(flow).model_dump_for_openapi()
    bad = {**deployment["parameters"], "reprocess": "sometimes"}
    with pytest.raises(Exception, match="sometimes"):
        validate(bad, schema, raise_on_error=True, preprocess=True, ignore_required=False)


def test_job_template_requests_gpus_and_reads_storage_secrets(job_template, prefect_yaml):
    variables = job_template["variables"]["properties"]
    placeholders = {p.name for p in find_placeholders(job_template["job_configuration"])}
    assert placeholders <= set(variables), f"undeclared: {placeholders - set(variables)}"
    pool_variables = prefect_yaml["deployments"][0]["work_pool"]["job_variables"]
    assert set(pool_variables) <= set(variables)

    defaults = {name: spec.get("default") for name, spec in variables.items()}
    config = apply_values(job_template["job_configuration"], {**defaults, **pool_variables})
    pod = config["job_manifest"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["envFrom"] == [{"secretRef": {"name": "shardline-storage"}}]
    assert container["image"] == "ghcr.io/shardline/worker:0.1.0"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert "{{" not in str({k: v for k, v in config.items() if k not in ("command", "env", "labels", "name")})


def test_dockerfile_pins_a_cuda_base_and_every_dependency_and_runs_as_non_root():
    dockerfile = (INFRA / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:\d+\.\d+\.\d+-\S+$", dockerfile, re.M)
    commands = re.findall(r"pip install (?!--no-deps)(?:--index-url \S+ )?(.*?)(?:&&|$)",
                          dockerfile.replace("\\\n", " "), re.M)
    requirements = [r.strip('"') for command in commands for r in command.split()]
    for requirement in requirements:
        assert "==" in requirement, f"unpinned {requirement!r} in the Dockerfile"
    assert {r.split("==")[0] for r in requirements} >= {
        "torch", "transformers", "prefect", "prefect-ray", "ray[default]", "s3fs", "pyarrow"}
    users = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert users and not users[-1].startswith(("root", "0"))


@pytest.mark.parametrize("script", ["start_object_store.sh", "start_local_stack.sh"])
def test_start_scripts_parse(script):
    path = INFRA / script
    assert path.stat().st_mode & 0o111, f"{script} is not executable"
    subprocess.run(["bash", "-n", str(path)], check=True)
