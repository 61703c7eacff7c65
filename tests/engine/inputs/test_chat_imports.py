"""Chat messages are checked (engine/inputs/chat.py) wherever OpenAI batch lines are
read, including processes that run no engine: importing the module loads no
transformers (the tokenizer type is only annotated)."""

from __future__ import annotations

import subprocess
import sys


def test_reading_chat_requests_imports_no_transformers():
    script = ("import sys\n"
              "import shardline.engine.inputs.chat, shardline.tasks.openai_requests\n"
              "print([name for name in ('transformers', 'torch') if name in sys.modules])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
