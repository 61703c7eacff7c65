"""The Triton mLSTM step loop (interpreted on CPU) against the plain-torch loop
(kernels/xlstm_mlstm.py's step_loop_varlen): requests with several tokens, one or
none, head sizes that are not powers of two over several value blocks, inputs with a
token stride wider than their rows, and states of requests without tokens holding
NaN (neither read nor written); then the packed mLSTM with it for its step tokens."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardline.engine.kernels._triton import triton_available
from shardline.engine.kernels.xlstm_mlstm import mlstm_varlen, step_loop_varlen
from shardline.engine.kernels.xlstm_mlstm_triton import mlstm_step_loop_triton

from .conftest import DEVICE

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

HEADS, DQK, DV = 2, 12, 40


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k [T, NH, DQK], v [T, NH, DV], i, f [T, NH] as views of one wide row per token."""
    gen = torch.Generator().manual_seed(seed)
    widths = [HEADS * DQK, HEADS * DQK, HEADS * DV, HEADS, HEADS]
    q, k, v, i, f = torch.split(torch.randn(tokens, sum(widths), generator=gen), widths, -1)
    return q.view(tokens, HEADS, DQK), k.view(tokens, HEADS, DQK), v.view(tokens, HEADS, DV), i * 4, f * 4


def _states(requests: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(requests, HEADS, DQK, DV, generator=gen), torch.randn(requests, HEADS, DQK, generator=gen),
            torch.randn(requests, HEADS, generator=gen)]


def test_triton_step_loop_matches_the_torch_loop():
    lengths, starts = torch.tensor([4, 1, 0, 6]), torch.tensor([0, 4, 5, 5])
    q, k, v, i, f = _inputs(11, seed=0)
    states = _states(4, seed=1)
    for state in states:
        state[2] = float("nan")
    expected = [state.clone() for state in states]
    want = step_loop_varlen(q, k, v, i, f, starts, lengths, expected[0], expected[1], expected[2], 1e-6,
                            torch.float32)
    got_states = [state.to(DEVICE) for state in states]
    q, k, v, i, f, starts, lengths = (tensor.to(DEVICE) for tensor in (q, k, v, i, f, starts, lengths))
    h = mlstm_step_loop_triton(q, k, v, i, f, starts, lengths, got_states[0], got_states[1], got_states[2], 1e-6,
                               torch.float32, block_v=16)
    torch.testing.assert_close(h.cpu(), want, rtol=1e-5, atol=1e-5)
    for name, got, state in zip("cnm", got_states, expected):
        torch.testing.assert_close(got.cpu(), state, rtol=1e-5, atol=1e-5, equal_nan=True, msg=f"state {name}")
        assert bool(got[2].isnan().all()), f"state {name} of the request without tokens was written"


def test_the_packed_mlstm_takes_the_triton_loop_for_its_step_tokens():
    lengths, has_state = [9, 1, 3], torch.tensor([True, False, True])
    q, k, v, i, f = _inputs(sum(lengths), seed=2)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    states = _states(len(lengths), seed=3)
    expected = [state.clone() for state in states]
    want = mlstm_varlen(q, k, v, i, f, cu, has_state, expected[0], expected[1], expected[2], 4, 1e-6, torch.float32)
    got_states = [state.to(DEVICE) for state in states]
    q, k, v, i, f, cu, has_state = (tensor.to(DEVICE) for tensor in (q, k, v, i, f, cu, has_state))
    h = mlstm_varlen(q, k, v, i, f, cu, has_state, got_states[0], got_states[1], got_states[2], 4, 1e-6,
                     torch.float32, mlstm_step_loop_triton)
    torch.testing.assert_close(h.cpu(), want, rtol=1e-4, atol=1e-4)
    for name, got, state in zip("cnm", got_states, expected):
        torch.testing.assert_close(got.cpu(), state, rtol=1e-4, atol=1e-4, msg=f"state {name}")


COMPILE_SCRIPT = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from cuda_compile import compile_launches, record_launches
from shardline.engine.kernels import xlstm_mlstm_triton
q, k, v = torch.randn(7, 2, 12), torch.randn(7, 2, 12), torch.randn(7, 2, 40)
i, f = torch.randn(7, 2), torch.randn(7, 2)
c, n, m = torch.zeros(3, 2, 12, 40), torch.zeros(3, 2, 12), torch.zeros(3, 2)
starts, lengths = torch.tensor([0, 4, 5]), torch.tensor([4, 1, 2])
launches = record_launches(lambda: xlstm_mlstm_triton.mlstm_step_loop_triton(
    q, k, v, i, f, starts, lengths, c, n, m, 1e-6, torch.float32), [xlstm_mlstm_triton])
print(chr(10).join(compile_launches("float32", launches, 90)), flush=True)
"""


@pytest.mark.slow
def test_the_step_loop_kernel_compiles_for_hopper():
    """Triton's real compiler (through ptxas), which the interpreter never runs, takes
    the kernel for sm_90."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend is not installed")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(Path(__file__).parent)], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].endswith(" ok"), lines
