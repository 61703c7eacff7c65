"""Flow tests run for real under the session-wide Prefect test harness."""

from __future__ import annotations

import pytest

from shardline.tasks.engine_cache import close_engines


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    close_engines()
