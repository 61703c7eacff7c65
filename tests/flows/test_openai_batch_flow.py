"""An OpenAI Batch job on S3 (SeaweedFS), killed with SIGKILL mid-run and rerun: every
output line in input order, once; bad lines as error lines; the job's _batch.json a
valid OpenAI Batch object whose counts and usage are the sums of the lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from openai.types import Batch
from prefect.settings import PREFECT_API_URL

from shardline.flows.batch_inference import batch_inference
from shardline.tasks.storage import filesystem

from ..openai_lines import read_output_lines
from .helpers import flow_run_record

NUM_SHARDS = 6
SAMPLING = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def _requests(shard: int) -> list[str]:
    """Eight request lines: chats and completions, one out-of-range field, and in shard 0
    a line that is not JSON."""
    lines = []
    for row in range(7):
        custom_id = f"s{shard}-r{row}"
        if row % 2:
            body = {"messages": [{"role": "user", "content": f"Question {shard}.{row}"}]}
            lines.append({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})
        else:
            body = {"prompt": f"Story {shard}.{row}:", "seed": row}
            lines.append({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})
    lines.append({"custom_id": f"s{shard}-bad", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": "x", "top_p": 1.5}})
    texts = [json.dumps(line) for line in lines]
    if shard == 0:
        texts.insert(3, "{this is not json")
    return texts


def _start_flow_subprocess(tmp_path, s3_server, prefix: str, tiny_model: str) -> subprocess.Popen:
    script = textwrap.dedent(f"""
        from shardline.flows.batch_inference import batch_inference
        from shardline.tasks.job import BatchJob
        batch_inference(BatchJob(
            input="s3://{prefix}/in", output="s3://{prefix}/out", model={tiny_model!r}, output_format="openai",
            sampling={SAMPLING!r}, engine_options={{"max_num_seqs": 4}}, shards_in_flight=2))
    """)  # credentials and endpoint come from the AWS_* environment, not the script
    env = {**os.environ, **s3_server.env(), "PREFECT_API_URL": PREFECT_API_URL.value()}
    return subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "killed-run.log", "wb"))


def test_openai_batch_on_s3_resumes_after_sigkill_with_usage_totals(tmp_path, s3_server, tiny_model, make_job):
    prefix, options = s3_server.new_prefix(), s3_server.storage_options()
    fs, _ = filesystem(f"s3://{prefix}", options)
    inputs = {f"batch-{shard}": _requests(shard) for shard in range(NUM_SHARDS)}
    for key, lines in inputs.items():
        fs.pipe_file(f"{prefix}/in/{key}.jsonl", "".join(line + "\n" for line in lines).encode())

    process = _start_flow_subprocess(tmp_path, s3_server, prefix, tiny_model)
    deadline = time.monotonic() + 240
    while True:
        fs.invalidate_cache()
        committed = fs.glob(f"{prefix}/out/_manifests/*.json")
        if len(committed) >= 2:
            break
        assert process.poll() is None, (tmp_path / "killed-run.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the flow committed no shard in time"
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait()
    fs.invalidate_cache()
    written_at = {path: json.loads(fs.cat_file(path))["written_at"]
                  for path in fs.glob(f"{prefix}/out/_manifests/*.json")}
    assert 2 <= len(written_at) < NUM_SHARDS, "the kill came too late to interrupt the run"

    job = make_job(input=f"s3://{prefix}/in", output=f"s3://{prefix}/out", output_format="openai",
                   sampling=SAMPLING, engine_options={"max_num_seqs": 4}, storage_options=options)
    state = batch_inference(job, return_state=True)
    summary = state.result()
    fs.invalidate_cache()
    statuses = {entry["shard"]: entry["status"] for entry in summary["shards"]}
    assert sorted(key for key, status in statuses.items() if status == "skipped") == \
        sorted(path.rsplit("/", 1)[1].removesuffix(".json") for path in written_at)
    assert {path: json.loads(fs.cat_file(path))["written_at"] for path in written_at} == written_at

    all_lines = []
    for key, requests in inputs.items():
        lines = read_output_lines(fs.cat_file(f"{prefix}/out/{key}.jsonl").decode())
        expected_ids = [json.loads(text)["custom_id"] if text.startswith('{"') else None for text in requests]
        assert [line["custom_id"] for line in lines] == expected_ids  # every line, in order, once
        failed = [line for line in lines if line["error"] is not None]
        assert read_output_lines(fs.cat_file(f"{prefix}/out/{key}.errors.jsonl").decode()) == failed
        assert {line["custom_id"] for line in failed} == {f"s{key[-1]}-bad"} | ({None} if key == "batch-0" else set())
        all_lines += lines
    assert fs.glob(f"{prefix}/out/_tmp/*") == []

    batch = json.loads(fs.cat_file(f"{prefix}/out/_batch.json"))
    Batch.model_validate(batch)
    assert summary["batch"] == batch
    usages = [line["response"]["body"]["usage"] for line in all_lines if line["error"] is None]
    failed = sum(line["error"] is not None for line in all_lines)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": len(all_lines), "completed": len(all_lines) - failed,
                                       "failed": failed}
    assert batch["usage"]["input_tokens"] == sum(u["prompt_tokens"] for u in usages) == \
        summary["totals"]["prompt_tokens"]
    assert batch["usage"]["output_tokens"] == sum(u["completion_tokens"] for u in usages) == \
        summary["totals"]["completion_tokens"] == len(usages) * SAMPLING["max_tokens"]
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] == \
        sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) == summary["totals"]["cached_prompt_tokens"]
    assert batch["endpoint"] == "/v1/chat/completions, /v1/completions"

    artifacts = flow_run_record(state.state_details.flow_run_id)["artifacts"]  # the job's usage in Prefect too
    table = artifacts["batch-inference-shards"].data
    table = json.loads(table) if isinstance(table, str) else table
    for name in ("rows", "errors", "prompt_tokens", "completion_tokens", "cached_prompt_tokens"):
        assert sum(row[name] for row in table) == summary["totals"][name], name
    assert "cached prompt tokens" in artifacts["batch-inference-summary"].data
