"""A DAG file that uses the provider parses without loading the engine.

Airflow's scheduler imports every DAG file again and again, each import under a time
limit (``dagbag_import_timeout``, 30 s by default): the engine's modules (torch,
transformers) must load when a task runs, never when its DAG file is parsed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "shardline.engine.llm", "shardline.tasks.shard_job")


@pytest.mark.parametrize("module", ["shardline.providers.airflow.example_dags.shardline_batch",
                                    "shardline.providers.airflow.operator", "shardline.providers.airflow.usage",
                                    "shardline.providers.airflow.listing", "shardline.providers.airflow.shard_batch"])
def test_importing_the_provider_loads_no_engine(module):
    probe = f"import sys, {module}; print([name for name in {HEAVY!r} if name in sys.modules])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", f"{module} imports {done.stdout.strip()}"


def test_the_operator_still_finds_the_engine_when_it_runs():
    from shardline.providers.airflow.shard_batch import ShardBatch
    from shardline.tasks.job import BatchJob

    batch = ShardBatch(BatchJob(input="/nonexistent-in", output="/nonexistent-out", model="/nonexistent-model"),
                       engine_service=False)
    assert type(batch._pipeline).__name__ == "ShardPipeline"
