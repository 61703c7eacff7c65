"""Fixtures for the shard functions: a job factory and an engine cache emptied after each test."""

from __future__ import annotations

from typing import Any

import pytest

from shardline.tasks.engine_cache import close_engines
from shardline.tasks.job import BatchJob


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    close_engines()


@pytest.fixture
def make_job(tiny_model: str, tmp_path):
    """make_job(**fields) -> a greedy, short BatchJob over tmp_path/in -> tmp_path/out."""

    def make(**fields: Any) -> BatchJob:
        values: dict[str, Any] = {
            "input": str(tmp_path / "in"), "output": str(tmp_path / "out"), "model": tiny_model,
            "sampling": {"max_tokens": 4, "temperature": 0.0}, "engine_options": {"max_num_seqs": 16},
        }
        values.update(fields)
        return BatchJob(**values)

    return make
