"""A process that only hands shards to an engine service (every Airflow task instance
does) imports the shard pipeline without torch: torch loads in the process that runs
the engine."""

from __future__ import annotations

import subprocess
import sys


def test_the_shard_pipeline_imports_without_torch():
    script = ("import sys\n"
              "import shardline.tasks.shard_job, shardline.tasks.engine_client, shardline.tasks.engine_cache\n"
              "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"
