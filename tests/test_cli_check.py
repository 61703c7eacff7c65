"""`shardline check MODEL`: the engine's verdict on a model, from its config alone."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from shardline.cli import main
from shardline.engine.model.tiny import tiny_config

from .engine.coverage import VOCAB_SIZE, tiny_overrides


def test_a_model_the_engine_runs_is_supported(tiny_model, capsys):
    assert main(["check", tiny_model]) == 0
    assert capsys.readouterr().out == "supported: LlamaForCausalLM (llama) can run on shardline (task generate)\n"
    assert main(["check", tiny_model, "--task", "embed"]) == 0
    assert capsys.readouterr().out == "supported: LlamaModel (llama) can run on shardline (task embed)\n"


def test_a_refused_model_prints_the_reason_and_exits_1(tiny_model, tmp_path, capsys):
    """A config and tokenizer with no weights is enough: the verdict reads no weights."""
    model = tmp_path / "blt"
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    tiny_config("blt", VOCAB_SIZE, **tiny_overrides("blt")).save_pretrained(str(model))
    assert main(["check", str(model), "--trust-remote-code"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("refused: BltForCausalLM (blt) cannot run on shardline: a byte-level patch model: an "
                          "entropy model cuts the bytes") and out.count("\n") == 1


@pytest.mark.parametrize("task", ["generate", "embed"])
def test_a_missing_model_exits_2_with_one_line(tmp_path, capsys, task):
    assert main(["check", str(tmp_path / "none"), "--task", task]) == 2
    assert capsys.readouterr().err == (f"shardline: check failed: load model {tmp_path / 'none'} failed: no such "
                                       "local directory (and a path is not a hub id)\n")


def test_the_command_line_entry_point(tiny_model):
    done = subprocess.run([sys.executable, "-m", "shardline", "check", tiny_model, "--task", "generate"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("supported: LlamaForCausalLM (llama)")
