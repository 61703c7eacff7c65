"""Shared by the examples: the model to run, a tiny random one built locally when none is given."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from shardline.engine.model.tiny import build_tiny_model


def model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="hub id or local directory (default: a tiny random model built in WORKDIR)")
    parser.add_argument("--workdir", default="shardline-examples", help="where inputs and outputs go")


def resolve_model(args: argparse.Namespace) -> str:
    """``--model``, or the absolute path of a tiny random-weight Llama built once under ``--workdir``
    (its text is noise; absolute, so a flow run started in another directory finds it)."""
    if args.model:
        return args.model
    model_dir = Path(args.workdir).resolve() / "tiny-model"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, arch="llama")
    return str(model_dir)


def shardline_run(input_dir: Path, output_dir: Path, model: str, *options: str) -> None:
    """``shardline run INPUT OUTPUT --model MODEL OPTIONS...`` as a user types it; its exit
    status is left to the caller's reading of the outputs (bad rows make error rows)."""
    subprocess.run([sys.executable, "-m", "shardline", "run", str(input_dir), str(output_dir), "--model", model,
                    *options], check=False)
