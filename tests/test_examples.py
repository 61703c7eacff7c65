"""The scripts in examples/ run as a user would run them, on a tiny random model.

Each runs in a subprocess with a timeout. The engine-API example runs by default; the
ones that start a Prefect flow (a temporary API server each) are marked slow.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_SECONDS = 600


def run_example(name: str, workdir: Path) -> str:
    completed = subprocess.run([sys.executable, str(REPO / "examples" / name), "--workdir", str(workdir)],
                               capture_output=True, text=True, timeout=TIMEOUT_SECONDS, cwd=REPO)
    assert completed.returncode == 0, f"{name} exited {completed.returncode}:\n{completed.stderr[-3000:]}"
    return completed.stdout


def test_offline_generate_and_chat(tmp_path):
    out = run_example("offline_generate.py", tmp_path)
    assert out.count("generate ") == 2 and "(length)" in out
    assert "chat -> " in out


@pytest.mark.slow
def test_structured_extraction_over_parquet(tmp_path):
    out = run_example("structured_extraction.py", tmp_path)
    rows = [line for line in out.splitlines() if line.startswith("{'id'")]
    assert [row.split("'")[3] for row in rows] == ["t1", "t2", "t3"]
    assert "max_tokens ended the output" in rows[2]


@pytest.mark.slow
def test_openai_batch_file(tmp_path):
    out = run_example("openai_batch.py", tmp_path)
    assert "q-1 ok:" in out and "q-2 ok:" in out
    assert "q-3 error: {'code': 'model_not_found'" in out
    assert "{'total': 3, 'completed': 2, 'failed': 1}" in out
