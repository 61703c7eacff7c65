"""CPU micro-benchmark of xLSTM's mLSTM over a packed batch: its token-by-token part
through the C kernel (kernels/cpu_xlstm.c) against the torch step loop
(kernels/xlstm_mlstm.py), float32, one thread, side by side in one process.

    python bench/bench_xlstm.py

At xLSTM-7B's head shapes (8 heads, key width 256, value width 512 per head) and a
smaller model's (4 heads, 64 x 128): a decode step of many requests and a prefill of
several requests' chunks that are not whole chunks of 64 (so part of each runs token
by token, as transformers runs it). Checks the kernel against the torch loop first,
then prints CPU milliseconds per call and the ratio.
"""

from __future__ import annotations

import functools
import time

import torch

from shardline.engine.kernels.cpu_xlstm import mlstm_kernel_available, mlstm_step_loop_cpu
from shardline.engine.kernels.xlstm_mlstm import mlstm_varlen, step_loop_varlen

SHAPES = [("7B heads", 8, 256, 512), ("small", 4, 64, 128)]
CASES = [("decode 16 x 1", [1] * 16, True), ("prefill 4 x 100", [100] * 4, False)]
CHUNK = 64


def _timed(fn, repeats: int) -> float:
    """CPU milliseconds per call (the host may be shared: CPU time, one thread)."""
    fn()
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats * 1e3


def _run(step_loop, inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> torch.Tensor:
    q, k, v, i, f, cu, flags = inputs
    c, n, m = (state.clone() for state in states)  # each call from the same saved states
    return mlstm_varlen(q, k, v, i, f, cu, flags, c, n, m, CHUNK, 1e-6, torch.float32, step_loop)


def main() -> None:
    assert mlstm_kernel_available(), "cpu_xlstm.c does not build here"
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    for shape_name, heads, dqk, dv in SHAPES:
        for name, lengths, continuing in CASES:
            tokens, requests = sum(lengths), len(lengths)
            q, k = (torch.randn(tokens, heads, dqk, generator=gen) for _ in range(2))
            v = torch.randn(tokens, heads, dv, generator=gen)
            i, f = (torch.randn(tokens, heads, generator=gen) * 3 for _ in range(2))
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
            flags = torch.full((requests,), continuing)
            states = [torch.randn(requests, heads, dqk, dv, generator=gen) * 0.1,
                      torch.randn(requests, heads, dqk, generator=gen) * 0.1, torch.zeros(requests, heads)]
            inputs = (q, k, v, i, f, cu, flags)
            torch_run = functools.partial(_run, step_loop_varlen, inputs, states)
            c_run = functools.partial(_run, mlstm_step_loop_cpu, inputs, states)
            torch.testing.assert_close(c_run(), torch_run(), rtol=1e-4, atol=1e-4)
            repeats = 20 if continuing else 2
            torch_ms, c_ms = _timed(torch_run, repeats), _timed(c_run, repeats)
            print(f"{shape_name:9s} {name:16s} torch {torch_ms:9.2f} ms   C {c_ms:8.2f} ms   {torch_ms / c_ms:6.1f}x",
                  flush=True)


if __name__ == "__main__":
    main()
