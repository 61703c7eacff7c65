"""Processes that run no engine import only what they use: one that only hands shards
to an engine service (every Airflow task instance does) imports the shard pipeline
without torch, and one that reads OpenAI batch lines checks their chat messages
(engine/inputs/chat.py) without transformers (the tokenizer type is only annotated).
Torch and transformers load in the process that runs the engine."""

from __future__ import annotations

import json
import subprocess
import sys


def _heavy_modules_after(modules: str) -> list[str]:
    """Which of torch and transformers a fresh interpreter holds after importing ``modules``."""
    script = ("import json, sys\n"
              f"import {modules}\n"
              "print(json.dumps([name for name in ('transformers', 'torch') if name in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip())


def test_the_shard_pipeline_imports_without_torch():
    loaded = _heavy_modules_after(
        "shardline.tasks.shard_job, shardline.tasks.engine_client, shardline.tasks.engine_cache")
    assert "torch" not in loaded


def test_reading_chat_requests_imports_no_transformers():
    assert _heavy_modules_after("shardline.engine.inputs.chat, shardline.tasks.openai_requests") == []
