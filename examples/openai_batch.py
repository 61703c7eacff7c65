"""An OpenAI Batch API input file run as a shardline job, giving OpenAI Batch output lines.

    python examples/openai_batch.py [--model Qwen/Qwen3-0.6B]

The same file runs on OpenAI (``client.batches.create``) or ``vllm run-batch``; here
each request's body names the job's model, and results land in ``<stem>.jsonl`` with
failed lines also in ``<stem>.errors.jsonl`` and the totals in ``_batch.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _tiny import model_argument, resolve_model, shardline_run


def requests(model: str) -> list[dict]:
    chat = {"model": model, "messages": [{"role": "user", "content": "Name a prime number."}],
            "max_completion_tokens": 16, "temperature": 0}
    completion = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "logprobs": 2}
    wrong_model = {"model": "not-this-job's-model", "prompt": "Hi", "max_tokens": 4}
    return [{"custom_id": "q-1", "method": "POST", "url": "/v1/chat/completions", "body": chat},
            {"custom_id": "q-2", "method": "POST", "url": "/v1/completions", "body": completion},
            {"custom_id": "q-3", "method": "POST", "url": "/v1/completions", "body": wrong_model}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_argument(parser)
    args = parser.parse_args()
    model = resolve_model(args)
    root = Path(args.workdir) / "openai-batch"
    (root / "batches").mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(request) + "\n" for request in requests(model))
    (root / "batches" / "requests.jsonl").write_text(lines)
    shardline_run(root / "batches", root / "results", model, "--output-format", "openai")
    for line in (root / "results" / "requests.jsonl").read_text().splitlines():
        result = json.loads(line)
        print(result["custom_id"], "error:" if result["error"] else "ok:", result["error"] or
              result["response"]["body"]["usage"])
    print(json.loads((root / "results" / "_batch.json").read_text())["request_counts"])


if __name__ == "__main__":
    main()
