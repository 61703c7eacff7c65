"""The kernels' compile cache (engine/kernels/native.py): processes that need the same
uncached library at once compile it once, the others waiting for it and loading the
library it built; without fcntl each builds it unlocked."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shardline.engine.kernels import native

SOURCE = "int answer(void) { return 42; }\n"

# Run by each builder: marks that it is about to build, then loads the library.
BUILDER = """
import sys
from pathlib import Path
from shardline.engine.kernels.native import NativeLibrary
Path(sys.argv[2]).touch()
library = NativeLibrary(Path(sys.argv[1]), lambda library: None, "no fallback").load()
assert library is not None
print(library._name, library.answer())
"""

# The C compiler the builders get (CC): each compile (a command with -o) appends a line
# to the counter and waits until both builders have marked that they are building, so
# without the lock both would be compiling at once.
COUNTING_COMPILER = """#!/bin/sh
case " $* " in *" -o "*)
  echo compile >> "{counter}"
  waited=0
  while [ ! -e "{markers}/0" ] || [ ! -e "{markers}/1" ]; do
    [ $waited -ge 600 ] && break
    sleep 0.05; waited=$((waited + 1))
  done;;
esac
exec "{compiler}" "$@"
"""


def real_compiler() -> str:
    compiler = native._compiler()
    if compiler is None or shutil.which(compiler) is None:
        pytest.skip("no C compiler (set CC)")
    return compiler


def test_two_processes_building_one_kernel_compile_it_once(tmp_path: Path):
    source, markers, counter = tmp_path / "answer.c", tmp_path / "markers", tmp_path / "compiles"
    source.write_text(SOURCE)
    markers.mkdir()
    wrapper = tmp_path / "cc"
    wrapper.write_text(COUNTING_COMPILER.format(counter=counter, markers=markers, compiler=real_compiler()))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "CC": str(wrapper), "SHARDLINE_CACHE_DIR": str(tmp_path / "cache")}
    builders = [subprocess.Popen([sys.executable, "-c", BUILDER, str(source), str(markers / str(index))], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for index in range(2)]
    results = [builder.communicate(timeout=120) for builder in builders]
    assert all(builder.returncode == 0 for builder in builders), [stderr for _, stderr in results]
    assert counter.read_text().splitlines() == ["compile"]  # one compile, the other builder waited
    loaded = {stdout.split()[0] for stdout, _ in results}
    assert [stdout.split()[1] for stdout, _ in results] == ["42", "42"]
    assert loaded == {str(path) for path in (tmp_path / "cache" / "kernels").glob("*.so")} and len(loaded) == 1


def test_without_fcntl_a_kernel_builds_unlocked(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_FCNTL", None)
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    library = native._build(source, real_compiler(), native.kernel_target())
    assert library.exists() and native._build(source, real_compiler(), native.kernel_target()) == library
    assert not list(library.parent.glob("*.lock"))
