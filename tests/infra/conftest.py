"""infra/ files: parsed and checked against Prefect's own validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

INFRA = Path(__file__).resolve().parents[2] / "infra"


@pytest.fixture(scope="session")
def prefect_yaml() -> dict:
    return yaml.safe_load((INFRA / "prefect.yaml").read_text())


@pytest.fixture(scope="session")
def job_template() -> dict:
    return json.loads((INFRA / "k8s-gpu-job-template.json").read_text())
