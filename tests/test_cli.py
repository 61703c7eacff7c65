"""The `shardline` command: run (over S3 reached through the AWS variables) and demo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardline.cli import main
from shardline.tasks.sample_data import write_sample_dataset


def test_run_over_s3_with_aws_environment_variables(s3_server, tiny_model, prefect_harness, monkeypatch, capsys):
    prefix = s3_server.new_prefix()
    write_sample_dataset(f"s3://{prefix}/in", num_shards=3, rows_per_shard=3,
                         storage_options=s3_server.storage_options())
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    argv = ["run", f"s3://{prefix}/in", f"s3://{prefix}/out", "--model", tiny_model, "--max-tokens", "3",
            "--temperature", "0", "--engine-options", '{"max_num_seqs": 8}', "--pass-through", "topic"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "part-00002  done" in printed and "TOTAL" in printed and f"s3://{prefix}/out" in printed
    assert main(argv) == 0
    assert "0 done/3 skipped/0 failed" in capsys.readouterr().out


def test_bad_command_lines_exit_2(tiny_model, capsys):
    with pytest.raises(SystemExit) as bad_json:
        main(["run", "in", "out", "--model", tiny_model, "--storage-options", "{not json"])
    assert bad_json.value.code == 2 and "not valid JSON" in capsys.readouterr().err
    assert main(["run", "in", "out", "--model", tiny_model, "--engine-options", '{"max_seqs": 2}']) == 2
    assert "unknown engine option(s) 'max_seqs'" in capsys.readouterr().err


def test_demo_console_script_runs_with_prefects_ephemeral_api(tmp_path):
    script = shutil.which("shardline", path=str(Path(sys.executable).parent)) or shutil.which("shardline")
    assert script, "the `shardline` console script is not installed (pip install -e '.[prefect,test]')"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    done = subprocess.run([script, "demo", str(tmp_path / "demo"), "--shards", "4", "--rows", "3"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TOTAL" in done.stdout and "4 done/0 skipped/0 failed" in done.stdout
    assert "outputs:" in done.stdout
    outputs = sorted((tmp_path / "demo" / "output").glob("*.parquet"))
    assert len(outputs) == 4 and {p.suffix for p in (tmp_path / "demo" / "input").iterdir()} == {".parquet", ".jsonl"}
    errors = [e for p in outputs for e in pq.read_table(p)["error"].to_pylist() if e]
    assert len(errors) == 3  # the demo's deliberate bad rows, one per early shard
