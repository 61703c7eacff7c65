"""The Airflow suite runs only in its own environment (.venv-airflow: Airflow 3, no
Prefect); elsewhere it is not collected.

Airflow reads its configuration when first imported, so AIRFLOW_HOME (a temporary
folder with a SQLite metadata database) and the DAGs folder are set here, before
any test module imports airflow. The DAGs folder holds the example DAG and the
test DAGs of tests/airflow/dags, copied: ``dag.test()`` runs only DAGs it finds there.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_DAG = ROOT / "providers" / "airflow" / "example_dags" / "shardline_batch.py"

if importlib.util.find_spec("airflow") is None:
    collect_ignore_glob = ["*.py"]
else:
    AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="shardline-airflow-"))
    DAGS_FOLDER = AIRFLOW_HOME / "dags"
    os.environ.update({
        "AIRFLOW_HOME": str(AIRFLOW_HOME),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
        "AIRFLOW__CORE__DEFAULT_TASK_RETRY_DELAY": "1",
        # the operator's shared engine services: their files here, gone soon after the tests
        "SHARDLINE_RUNTIME_DIR": str(AIRFLOW_HOME / "run"),
        "SHARDLINE_ENGINE_IDLE_TIMEOUT": "60",
    })


@pytest.fixture(scope="session")
def airflow_db():
    """A fresh metadata database and the DAGs folder, once per session."""
    DAGS_FOLDER.mkdir(exist_ok=True)
    for dag_file in [EXAMPLE_DAG, *(ROOT / "tests" / "airflow" / "dags").glob("*.py")]:
        shutil.copy(dag_file, DAGS_FOLDER / dag_file.name)
    from airflow.utils import db

    db.resetdb()
    return AIRFLOW_HOME


def pytest_sessionfinish(session, exitstatus):
    if "AIRFLOW_HOME" in globals():
        stop_engine_services(AIRFLOW_HOME / "run")
        shutil.rmtree(AIRFLOW_HOME, ignore_errors=True)


def stop_engine_services(runtime_dir: Path) -> None:
    """SIGTERM every shared engine service with files in ``runtime_dir`` (they retire cleanly)."""
    for pid_file in runtime_dir.glob("*.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            pass  # already gone


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    from shardline.tasks.engine_cache import close_engines

    close_engines()


@pytest.fixture
def no_aws_environment(monkeypatch):
    """No AWS_* variables, so storage credentials can only come from the Airflow connection."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
