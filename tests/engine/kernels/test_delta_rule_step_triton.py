"""The Triton decode step of the gated delta rule (interpreted on CPU) against the
batched torch steps, for the gated delta-net (a log-decay per head) and Kimi delta
attention (one per key channel): several requests with saved states, float32 and
bfloat16 inputs, a key width that is not a power of two, values over several blocks,
several steps in a row."""

import pytest
import torch

from shardline.engine.kernels._triton import triton_available
from shardline.engine.kernels.delta_rule_step import delta_rule_step_triton
from shardline.engine.kernels.recurrent_reference import kda_step_reference, l2_normalize
from shardline.engine.recurrent.delta_rule import gated_delta_rule_step

from .conftest import DEVICE

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@pytest.mark.parametrize("per_key", [False, True], ids=["gated_delta_net", "kda"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_delta_rule_step_matches_the_torch_step(per_key, dtype, tol):
    gen = torch.Generator().manual_seed(0)
    requests, heads, key_dim, value_dim, steps = 3, 2, 12, 40, 3
    state = torch.randn(requests, heads, key_dim, value_dim, generator=gen)
    expected_state = state.clone()
    kernel_state = state.to(DEVICE)
    for _ in range(steps):
        q = l2_normalize(torch.randn(requests, heads, key_dim, generator=gen)) * key_dim ** -0.5
        k = l2_normalize(torch.randn(requests, heads, key_dim, generator=gen))
        v = torch.randn(requests, heads, value_dim, generator=gen)
        g = -torch.rand(requests, heads, *((key_dim,) if per_key else ()), generator=gen)
        beta = torch.rand(requests, heads, generator=gen)
        inputs = [t.to(dtype) for t in (q, k, v, g, beta)]
        out = delta_rule_step_triton(*(t.to(DEVICE) for t in inputs), kernel_state, block_v=16)
        assert out.dtype == dtype
        q, k, v, g, beta = (t.float() for t in inputs)  # the values the kernel read
        if per_key:
            expected = kda_step_reference(expected_state, q, k, v, g, beta)
        else:
            expected, _ = gated_delta_rule_step(q, k, v, g, beta, expected_state)
        torch.testing.assert_close(out.float().cpu(), expected, rtol=tol, atol=tol)
        torch.testing.assert_close(kernel_state.cpu(), expected_state, rtol=1e-5, atol=1e-5)
