"""The C kernels build for other architectures' targets than the host's: ARM with
NEON, where an aarch64 cross compiler is installed (`gcc-aarch64-linux-gnu`)."""

import shutil

import pytest

from shardline.engine.kernels import cpu_attention, cpu_fused, cpu_prefill_attention, native

CROSS_COMPILER = shutil.which("aarch64-linux-gnu-gcc")


@pytest.mark.skipif(CROSS_COMPILER is None, reason="no aarch64 cross compiler (apt install gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("source", [cpu_attention.SOURCE, cpu_prefill_attention.SOURCE, cpu_fused.SOURCE],
                         ids=lambda source: source.name)
@pytest.mark.parametrize("target", ["armv8-a", "armv8.2-a+bf16"])
def test_kernels_build_for_arm(source, target, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))
    assert native.compiler_vector_isa(CROSS_COMPILER, target) == "neon"
    library = native._build(source, CROSS_COMPILER, target)
    assert library.read_bytes()[:4] == b"\x7fELF" and library.read_bytes()[18] == 183  # e_machine: AArch64
