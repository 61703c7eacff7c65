"""A marker for tests that assert a CPU fast path is taken."""

from __future__ import annotations

import pytest

from shardline.engine.cpu.paths import path_settings


def taken_unless_forced_off(*names: str) -> pytest.MarkDecorator:
    """Skip a test that asserts the CPU paths ``names`` are taken when
    SHARDLINE_CPU_PATHS turns any of them off (read as the engine reads it)."""
    off = [name for name in names if path_settings().get(name) is False]
    return pytest.mark.skipif(bool(off), reason=f"SHARDLINE_CPU_PATHS turns off {', '.join(off)}, "
                                                "a path this test asserts is taken")
