"""``shardline run`` over an OpenAI Batch request file, as a vllm run-batch user would call it."""

from __future__ import annotations

import json

from openai.types import Batch

from shardline.cli import main

from .openai_lines import read_output_lines


def test_run_with_output_format_openai_prints_usage_and_writes_the_batch_object(
        tmp_path, tiny_model, prefect_harness, capsys):
    requests = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Question {i}"}]}}
                for i in range(3)]
    requests.append({"custom_id": "q3", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": "other", "messages": [{"role": "user", "content": "Hi"}]}})
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    argv = ["run", str(tmp_path / "in"), str(tmp_path / "out"), "--model", tiny_model, "--served-model-name",
            "tiny", "--output-format", "openai", "--max-tokens", "3", "--temperature", "0"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "cached_prompt_tokens" in printed.splitlines()[0]

    lines = read_output_lines((tmp_path / "out" / "requests.jsonl").read_text())
    assert [line["custom_id"] for line in lines] == ["q0", "q1", "q2", "q3"]
    assert {line["response"]["body"]["model"] for line in lines[:3]} == {"tiny"}
    assert lines[3]["error"]["code"] == "model_not_found" and "'other'" in lines[3]["error"]["message"]
    batch = Batch.model_validate_json((tmp_path / "out" / "_batch.json").read_text())
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    assert batch.usage.output_tokens == sum(line["response"]["body"]["usage"]["completion_tokens"]
                                            for line in lines[:3]) > 0
    assert batch.model == "tiny" and batch.status == "completed"
