"""examples/airflow_dag.py runs as a user would run it: the provider's example DAG,
``dag.test()`` once per day over local files, on a tiny random model."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .conftest import ROOT, stop_engine_services

TIMEOUT_SECONDS = 600


def test_airflow_dag_example_runs_a_day_per_dag_run(tmp_path):
    # The example sets up an Airflow home of its own: none of this session's settings go with it.
    env = {name: value for name, value in os.environ.items() if not name.startswith("AIRFLOW")}
    runtime_dir = Path(tempfile.mkdtemp(prefix="sl-"))  # short: it holds the engine service's Unix socket
    env["SHARDLINE_RUNTIME_DIR"] = str(runtime_dir)
    try:
        done = subprocess.run([sys.executable, str(ROOT / "examples" / "airflow_dag.py"), "--workdir", str(tmp_path)],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
    finally:
        stop_engine_services(runtime_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = [line for line in done.stdout.splitlines() if line.startswith("DAG run ")]
    assert len(runs) == 2 and all(run.endswith(": success") for run in runs), done.stdout
    assert done.stdout.count("  tasks: batch_usage success, infer[0] success, infer[1] success, "
                             "list_shards success") == 2
    assert done.stdout.count("  outputs: ['part-00000.parquet', 'part-00001.parquet']") == 2
    assert done.stdout.count("  request counts: {'total': 8, 'completed': 8, 'failed': 0}") == 2
    assert (tmp_path / "airflow-example" / "completions" / "date=2025-01-02" / "_manifests").is_dir()
