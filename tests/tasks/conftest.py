"""Fixtures for the shard functions: an engine cache emptied after each test."""

from __future__ import annotations

import pytest

from shardline.tasks.engine_cache import close_engines


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    close_engines()
