"""The scripts in examples/ run as a user would run them, on a tiny random model.

Each runs in a subprocess with a timeout. The ones that run Prefect flows report to the
session's test server (``prefect_harness``, through PREFECT_API_URL), as the project's
other subprocess tests do, so none of them starts a temporary server of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_SECONDS = 600


@pytest.fixture
def prefect_env(prefect_harness) -> dict[str, str]:
    """This environment with PREFECT_API_URL naming the session's Prefect test server."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}


def run_example(name: str, workdir: Path, env: dict[str, str] | None = None) -> str:
    completed = subprocess.run([sys.executable, str(REPO / "examples" / name), "--workdir", str(workdir)],
                               capture_output=True, text=True, timeout=TIMEOUT_SECONDS, cwd=REPO, env=env)
    assert completed.returncode == 0, f"{name} exited {completed.returncode}:\n{completed.stderr[-3000:]}"
    return completed.stdout


def test_offline_generate_and_chat(tmp_path):
    out = run_example("offline_generate.py", tmp_path)
    assert out.count("generate ") == 2 and "(length)" in out
    assert "chat -> " in out


@pytest.mark.slow
def test_structured_extraction_over_parquet(tmp_path, prefect_env):
    out = run_example("structured_extraction.py", tmp_path, prefect_env)
    rows = [line for line in out.splitlines() if line.startswith("{'id'")]
    assert [row.split("'")[3] for row in rows] == ["t1", "t2", "t3"]
    assert "max_tokens ended the output" in rows[2]


@pytest.mark.slow
def test_openai_batch_file(tmp_path, prefect_env):
    out = run_example("openai_batch.py", tmp_path, prefect_env)
    assert "q-1 ok:" in out and "q-2 ok:" in out
    assert "q-3 error: {'code': 'model_not_found'" in out
    assert "{'total': 3, 'completed': 2, 'failed': 1}" in out


@pytest.mark.slow
def test_prefect_deployment_serves_a_backfill_and_its_rerun_skips_every_partition(tmp_path, prefect_env):
    out = run_example("prefect_backfill.py", tmp_path, prefect_env)
    runs = [line for line in out.splitlines() if line.startswith("flow run ")]
    assert len(runs) == 2 and all(run.endswith(": Completed") for run in runs), out
    first, again = out.split(runs[1])
    for partition in ("date=2025-01-01", "date=2025-01-02", "date=2025-01-03"):
        assert f"{partition}: run (never run: 0 of 2 shard(s) done); last run completed" in first
        assert f"{partition}: skip (all 2 shard(s) have manifests matching the job" in again
    assert out.count("outputs ['part-00000.parquet', 'part-00001.parquet']") == 6
    assert "date=2025-01-01 request counts: {'total': 8, 'completed': 8, 'failed': 0}" in out
