"""The built wheel contains every subpackage the design card maps into shardline."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _source_packages() -> set[str]:
    """Every folder with an __init__.py under the mapped top-level folders."""
    packages = set()
    for top, name in (("shardline", "shardline"), ("engine", "shardline.engine"),
                      ("tasks", "shardline.tasks"), ("flows", "shardline.flows"),
                      ("providers", "shardline.providers")):
        for init in (ROOT / top).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / top)
            packages.add(".".join([name, *relative.parts]) if relative.parts else name)
    return packages


def test_pyproject_lists_every_subpackage():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert set(pyproject["tool"]["setuptools"]["packages"]) == _source_packages()


def test_wheel_contains_every_subpackage(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )
    [wheel] = tmp_path.glob("shardline-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in _source_packages():
        init = package.replace(".", "/") + "/__init__.py"
        assert init in names, f"{package} is missing from the wheel"
    assert "shardline/engine/llm.py" in names
    for source in ("cpu_decode_attention.c", "cpu_fused.c", "cpu_common.h"):  # compiled on the worker
        assert f"shardline/engine/kernels/{source}" in names
    assert any(n.endswith("entry_points.txt") for n in names)
