"""The mLSTM step loop in C (kernels/cpu_xlstm.c) against its plain-torch reference
(kernels/xlstm_mlstm.py's step_loop_varlen): requests with saved and fresh states,
with several tokens, one, or none, on strided inputs as the layer's fused projection
gives them; state rows of requests without tokens hold NaN, so a stray read or
write shows."""

from __future__ import annotations

import pytest
import torch

from shardline.engine.kernels.cpu_xlstm import mlstm_kernel_available, mlstm_step_loop_cpu
from shardline.engine.kernels.xlstm_mlstm import mlstm_varlen, step_loop_varlen

pytestmark = pytest.mark.skipif(not mlstm_kernel_available(), reason="cpu_xlstm.c does not build here")

HEADS, DQK, DV = 3, 16, 24


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k [T, NH, DQK], v [T, NH, DV], i, f [T, NH] as views of one wide row per token."""
    gen = torch.Generator().manual_seed(seed)
    widths = [HEADS * DQK, HEADS * DQK, HEADS * DV, HEADS, HEADS]
    rows = torch.randn(tokens, sum(widths), generator=gen)
    q, k, v, i, f = torch.split(rows, widths, -1)
    return (q.view(tokens, HEADS, DQK), k.view(tokens, HEADS, DQK), v.view(tokens, HEADS, DV), i * 4, f * 4)


def _states(requests: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(requests, HEADS, DQK, DV, generator=gen), torch.randn(requests, HEADS, DQK, generator=gen),
            torch.randn(requests, HEADS, generator=gen)]


def test_the_c_step_loop_matches_the_torch_loop():
    lengths = [5, 1, 0, 9, 2]
    starts = [0, 5, 6, 6, 15]
    q, k, v, i, f = _inputs(17, seed=0)
    states = _states(len(lengths), seed=1)
    for state in states:
        state[2] = float("nan")  # request 2 has no tokens: its state is neither read nor written
    ours, theirs = [s.clone() for s in states], [s.clone() for s in states]
    starts_t, lengths_t = torch.tensor(starts), torch.tensor(lengths)
    h = mlstm_step_loop_cpu(q, k, v, i, f, starts_t, lengths_t, ours[0], ours[1], ours[2], 1e-6, torch.float32)
    want = step_loop_varlen(q, k, v, i, f, starts_t, lengths_t, theirs[0], theirs[1], theirs[2], 1e-6, torch.float32)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)
    for name, got, expected in zip("cnm", ours, theirs):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True, msg=f"state {name}")
    assert all(bool(state[2].isnan().all()) for state in ours)


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_the_packed_mlstm_takes_the_c_loop_for_its_step_tokens(chunk_size):
    """Through mlstm_varlen: whole chunks in torch, the tokens after them in C."""
    lengths, has_state = [11, 1, 6, 3], torch.tensor([True, False, True, False])
    q, k, v, i, f = _inputs(sum(lengths), seed=2)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    states = _states(len(lengths), seed=3)
    ours, theirs = [s.clone() for s in states], [s.clone() for s in states]
    h = mlstm_varlen(q, k, v, i, f, cu, has_state, ours[0], ours[1], ours[2], chunk_size, 1e-6, torch.float32,
                     mlstm_step_loop_cpu)
    want = mlstm_varlen(q, k, v, i, f, cu, has_state, theirs[0], theirs[1], theirs[2], chunk_size, 1e-6, torch.float32)
    torch.testing.assert_close(h, want, rtol=1e-4, atol=1e-4)
    for name, got, expected in zip("cnm", ours, theirs):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"state {name}")
