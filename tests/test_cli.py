"""The `shardline` command: run (over S3 reached through the AWS variables) and demo."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
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


# CI runs `shardline demo` itself as the README's set-up command; this runs with the slow set.
@pytest.mark.slow
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


# --- Issue 19: one line per error, fast pre-flight failures, clean SIGTERM -------------------

def _run_cli(argv: list[str], capsys) -> tuple[int, float, list[str]]:
    """(exit code, seconds, stderr lines) of ``shardline`` run in this process."""
    from shardline.tasks.engine_cache import engine_loads, engine_requests

    loads, requests = engine_loads(), engine_requests()
    started = time.monotonic()
    code = main(argv)
    elapsed = time.monotonic() - started
    captured = capsys.readouterr()
    assert engine_loads() == loads and engine_requests() == requests  # failed before any engine work
    assert "Traceback" not in captured.out + captured.err
    return code, elapsed, captured.err.splitlines()


def test_invalid_fields_print_one_line_each(tiny_model, capsys):
    code, _, lines = _run_cli(["run", "in", "out", "--model", tiny_model, "--max-tokens", "-5", "--top-p", "3"],
                              capsys)
    assert code == 2
    assert lines == ["shardline run: --max-tokens must be >= 1, got -5",
                     "shardline run: --top-p must be <= 1.0, got 3.0"]


def test_an_unknown_model_fails_in_seconds_with_one_line(tmp_path, capsys):
    write_sample_dataset(str(tmp_path / "in"), num_shards=1, rows_per_shard=2)
    for model in (str(tmp_path / "no-such-model"), "no-such-org/no-such-model"):
        code, elapsed, lines = _run_cli(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--model", model], capsys)
        assert code == 2, (elapsed, lines)
        assert len(lines) == 1
        assert lines[0].startswith(f"shardline: pre-flight check failed: load model {model} failed:")
        with capsys.disabled():
            print(f"\nunknown model {model}: exit {code} in {elapsed:.1f}s: {lines}")


def test_debug_shows_the_traceback_of_an_expected_error(tmp_path, capsys, monkeypatch):
    write_sample_dataset(str(tmp_path / "in"), num_shards=1, rows_per_shard=2)
    argv = ["run", str(tmp_path / "in"), str(tmp_path / "out"), "--model", str(tmp_path / "none")]
    assert main(["--debug", *argv]) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("SHARDLINE_DEBUG", "0")
    assert main(argv) == 2
    assert "Traceback" not in capsys.readouterr().err


def _s3_faults(server, prefix: str) -> dict[str, tuple[str, str, dict, str]]:
    """name -> (input URL, output URL, storage options, what one of the lines must say)."""
    wrong = {**server.storage_options(), "secret": "a-wrong-SECRET-value-9d1"}
    missing = "s3://no-such-bucket-shardline"
    return {
        "read-only key": (f"s3://{prefix}/in", f"s3://{prefix}/out", server.reader_options(),
                          f"write s3://{prefix}/out/_tmp/.shardline-probe-"),
        "missing bucket": (f"{missing}/in", f"{missing}/out", server.writer_options(),
                           f"list {missing}/in failed: FileNotFoundError"),
        "wrong credentials": (f"s3://{prefix}/in", f"s3://{prefix}/out", wrong,
                              f"list s3://{prefix}/in failed: PermissionError"),
    }


def test_permanent_storage_faults_fail_in_seconds_naming_object_and_operation(controlled_s3, tiny_model, capsys,
                                                                              caplog):
    prefix = controlled_s3.new_prefix()
    write_sample_dataset(f"s3://{prefix}/in", num_shards=2, rows_per_shard=2,
                         storage_options=controlled_s3.storage_options())
    for name, (input_url, output, options, expected) in _s3_faults(controlled_s3, prefix).items():
        argv = ["run", input_url, output, "--model", tiny_model, "--storage-options", json.dumps(options)]
        caplog.clear()
        with caplog.at_level("WARNING", logger="shardline.tasks.storage"):
            code, elapsed, lines = _run_cli(argv, capsys)
        assert code == 2, (name, elapsed, lines)
        # A permanent error is never retried (a retry logs "retry N in ..." here).
        assert not [r for r in caplog.records if "; retry " in r.getMessage()], (name, caplog.text)
        assert any(expected in line for line in lines), (name, lines)
        assert all(line.startswith("shardline: pre-flight check failed: ") for line in lines), (name, lines)
        assert all(secret not in "\n".join(lines) for secret in (options["secret"], controlled_s3.secret_key,
                                                                  controlled_s3.access_key)), (name, lines)
        with capsys.disabled():
            print(f"\n{name}: exit {code} in {elapsed:.1f}s: {lines}")
    fs = s3fs_for(controlled_s3)
    assert not fs.exists("no-such-bucket-shardline")  # the probe never creates a bucket


def s3fs_for(server):
    import s3fs

    return s3fs.S3FileSystem(**server.storage_options(), skip_instance_cache=True)


def test_sigterm_aborts_the_run_leaves_no_process_and_a_rerun_resumes(tmp_path, tiny_model, make_job,
                                                                         prefect_harness):
    from shardline.flows.batch_inference import batch_inference
    from shardline.tasks.engine_cache import engine_requests
    from shardline.tasks.process_tree import command_line, descendants, is_alive

    # Rows of 64 tokens keep the run going well past the first commit, so SIGTERM lands
    # mid-run; the rerun then generates what the stopped run left.
    shards, rows = 6, 4
    write_sample_dataset(str(tmp_path / "in"), num_shards=shards, rows_per_shard=rows, with_bad_rows=False)
    script = shutil.which("shardline", path=str(Path(sys.executable).parent))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    argv = [script, "run", str(tmp_path / "in"), str(tmp_path / "out"), "--model", tiny_model, "--max-tokens", "64",
            "--temperature", "0", "--engine-options", '{"max_num_seqs": 4}', "--shards-in-flight", "2"]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    manifests = tmp_path / "out" / "_manifests"
    deadline = time.monotonic() + 240
    while not (manifests.exists() and any(manifests.glob("*.json"))):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no shard committed in time"
        time.sleep(0.05)
    tree = {pid: command_line(pid) for pid in descendants(process.pid)}
    assert any("uvicorn" in command for command in tree.values()), tree  # Prefect's temporary API server
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    stop_seconds = time.monotonic() - started
    # Stopped, not drained: shards were left uncommitted (asserted below); communicate's
    # timeout catches a hang. How fast it stops is not asserted (a loaded machine varies it).
    assert process.returncode == 143, err[-3000:]
    time.sleep(0.5)
    assert [pid for pid in tree if is_alive(pid)] == [], tree  # nothing left behind, nothing adopted by init
    assert "stopped by SIGTERM" in err and "Traceback" not in err

    committed = sorted(p.stem for p in manifests.glob("*.json"))
    assert 1 <= len(committed) < shards
    assert sorted(p.stem for p in (tmp_path / "out").glob("*.parquet")) == committed  # nothing partial
    assert not any((tmp_path / "out" / "_tmp").glob("*"))
    job = make_job(sampling={"max_tokens": 64, "temperature": 0.0}, engine_options={"max_num_seqs": 4})
    before = engine_requests()
    summary = batch_inference(job)
    statuses = {entry["shard"]: entry["status"] for entry in summary["shards"]}
    assert sorted(k for k, s in statuses.items() if s == "skipped") == committed
    assert engine_requests() - before == rows * (shards - len(committed))  # only the uncommitted shards ran
    print(f"\nSIGTERM: exit 143 after {stop_seconds:.1f}s; {len(tree)} child process(es) before, none after; "
          f"{len(committed)} shard(s) kept; rerun ran {engine_requests() - before} requests")
