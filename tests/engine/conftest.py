from __future__ import annotations

import pytest

from shardline.engine.model.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama-shaped model with a byte-level tokenizer, built once."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    """One float64 engine shared by tests that leave it without unfinished requests."""
    from shardline import LLM

    return LLM(tiny_llama_dir, dtype="float64", max_num_seqs=8)
