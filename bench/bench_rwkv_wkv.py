"""CPU micro-benchmark of RWKV's WKV scan: the C kernel (kernels/cpu_rwkv.c) against
the torch scan (kernels/rwkv_wkv.py), float32, side by side in one process.

    python bench/bench_rwkv_wkv.py

At RWKV-4 169M's width (768 channels) and 1.5B's (2048): a prefill of several
requests' chunks and a decode step of many requests. Checks the kernel against the
torch scan first, then prints milliseconds per call and the ratio.
"""

from __future__ import annotations

import functools
import time

import torch

from shardline.engine.kernels.cpu_rwkv import rwkv_kernel_available, wkv_varlen_cpu
from shardline.engine.kernels.rwkv_wkv import wkv_varlen

CASES = [("prefill 4 x 256", [256] * 4, False), ("decode 64 x 1", [1] * 64, True)]


def _timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def _run(scan, args: tuple, states: list[torch.Tensor]) -> torch.Tensor:
    return scan(*args, *(state.clone() for state in states))  # each call from the same saved states


def main() -> None:
    assert rwkv_kernel_available(), "cpu_rwkv.c does not build here"
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}")
    for width in (768, 2048):
        time_decay, first = torch.randn(width, generator=gen), torch.randn(width, generator=gen)
        decay = -torch.exp(time_decay)
        for name, lengths, continuing in CASES:
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
            key = torch.randn(sum(lengths), width, generator=gen) * 3
            value = torch.randn(sum(lengths), width, generator=gen)
            flags = torch.full((len(lengths),), continuing)
            states = [torch.rand(len(lengths), width, generator=gen) for _ in range(3)]

            inputs = (key, value, cu, flags)
            torch_scan = functools.partial(_run, wkv_varlen, (time_decay, first, *inputs), states)
            c_scan = functools.partial(_run, wkv_varlen_cpu, (decay, first, *inputs), states)

            torch.testing.assert_close(c_scan(), torch_scan(), rtol=1e-4, atol=1e-4)
            repeats = 3 if not continuing else 50
            torch_ms, c_ms = _timed(torch_scan, repeats), _timed(c_scan, repeats)
            print(f"width {width:5d} {name:16s} torch {torch_ms:9.3f} ms   C {c_ms:8.3f} ms   {torch_ms / c_ms:6.1f}x")


if __name__ == "__main__":
    main()
