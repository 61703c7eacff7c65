"""The CPU engine's malloc thresholds keep step temporaries in the heap."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from shardline.engine.cpu import memory as cpu_memory

# A fresh interpreter: the thresholds are process-wide and set once. torch and then
# tokenizers are imported as in an engine process: measured, glibc's own adaptive
# threshold then maps these two 12 MB temporaries anew on every call in about two
# runs of three (6112 page faults a call).
SCRIPT = """
import resource, sys
import torch
import tokenizers  # noqa: F401
from shardline.engine.cpu.memory import keep_freed_memory
applied = keep_freed_memory()
a, b = torch.randn(2048, 1536), torch.randn(2048, 1536)
def faults_per_call():
    for _ in range(20):  # glibc settles after a few rounds of growing the heap
        torch.nn.functional.silu(a) * b
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.nn.functional.silu(a) * b
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 20
print(applied, faults_per_call())
"""


def run_script(env_extra: dict[str, str]) -> tuple[str, float]:
    env = {**os.environ, **env_extra}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    applied, faults = result.stdout.split()
    return applied, float(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_freed_temporaries_are_reused_without_page_faults():
    applied, faults = run_script({})
    assert applied == "True"
    # A 12 MB temporary is 3072 pages; reused heap memory faults on none of them.
    assert faults < 100, faults


def test_opt_out_leaves_the_allocator_alone():
    applied, _ = run_script({"SHARDLINE_MALLOC_TUNING": "0"})
    assert applied == "False"


def test_applied_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_memory, "_applied", None)
    monkeypatch.setattr(cpu_memory, "_apply", lambda: calls.append(1) or True)
    assert cpu_memory.keep_freed_memory() and cpu_memory.keep_freed_memory()
    assert calls == [1]


def vm_flags_at(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "VmFlags:":
                return fields[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def huge_pages_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return setting.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise(MADV_HUGEPAGE) is Linux's")
@pytest.mark.parametrize("opt_out", [False, True])
def test_huge_page_zeros_advises_whole_huge_pages(monkeypatch, opt_out):
    if opt_out:
        monkeypatch.setenv("SHARDLINE_HUGE_PAGES", "0")
    else:
        monkeypatch.delenv("SHARDLINE_HUGE_PAGES", raising=False)
    madvise = cpu_memory._madvise_function()
    calls: list[tuple[int, int, int]] = []

    def recorded(start: int, length: int, advice: int) -> int:  # the real call, recorded
        calls.append((start, length, advice))
        return madvise(start, length, advice)

    monkeypatch.setattr(cpu_memory, "_madvise_function", lambda: recorded)
    # 40 MiB: above glibc's largest mmap threshold, so a fresh mapping
    tensor = cpu_memory.huge_page_zeros((10, 1 << 20), torch.float32)
    assert tensor.shape == (10, 1 << 20) and tensor.dtype == torch.float32
    assert not tensor.any()
    interior = -(-tensor.data_ptr() // cpu_memory.HUGE_PAGE_BYTES) * cpu_memory.HUGE_PAGE_BYTES
    if opt_out:  # the mapping's own flags can carry advice its addresses had before
        assert calls == []
        return
    end = (tensor.data_ptr() + tensor.nbytes) // cpu_memory.HUGE_PAGE_BYTES * cpu_memory.HUGE_PAGE_BYTES
    assert calls == [(interior, end - interior, cpu_memory.MADV_HUGEPAGE)]
    if huge_pages_mode() in ("always", "madvise"):
        assert "hg" in vm_flags_at(interior)


def test_small_buffers_keep_ordinary_pages():
    tensor = cpu_memory.huge_page_zeros((16, 16), torch.bfloat16)
    assert tensor.shape == (16, 16) and tensor.dtype == torch.bfloat16 and not tensor.any()
