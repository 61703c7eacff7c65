"""W8A8 experts quantize a bfloat16 input in bfloat16, as compressed-tensors' own
forward does (the per-token scale and codes computed in the input's dtype), not after
widening it to float32; weight-only experts still take float32 inputs."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
from torch import nn

from shardline.engine.quantization.experts import LinearsPerExpert, stack_w8
from shardline.engine.quantization.linear import QuantizedLinear

INPUTS = QuantizationArgs(**{"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True})
WIDTH = 96


def _compressed_tensors_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] as compressed-tensors' forward quantizes a linear's input, in x's dtype."""
    tokens = x.unsqueeze(0)
    scale, zero_point = compute_dynamic_scales_and_zp(value=tokens, args=INPUTS, module=nn.Module())
    return fake_quantize(tokens, scale, zero_point, INPUTS).view_as(x)


def _identity_experts(input_quantization: str, num_experts: int = 2) -> LinearsPerExpert:
    """gate and up of every expert: the identity in int8 codes, scale 1 per channel, so
    the product is the (quantized) input itself, exactly."""
    def part() -> list[QuantizedLinear]:
        linears = []
        for _ in range(num_experts):
            linear = QuantizedLinear.w8(torch.eye(WIDTH, dtype=torch.int8), torch.ones(WIDTH, 1), None)
            linear.input_quantization = "int8" if input_quantization == "int8" else "none"
            linears.append(linear)
        return linears
    return stack_w8({"gate": part(), "up": part()})


@pytest.mark.parametrize("kernels", [True, False])
def test_w8a8_experts_quantize_bfloat16_inputs_in_bfloat16(kernels):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(7, WIDTH, generator=generator) * torch.rand(7, 1, generator=generator) * 4).bfloat16()
    x[:, 5] *= 30  # an outlier channel: a coarse per-token scale
    expected = _compressed_tensors_fake_quantize(x)
    widened = _compressed_tensors_fake_quantize(x.float())
    assert not torch.equal(widened.bfloat16(), expected)  # the dtype of the quantization shows
    experts = _identity_experts("int8")
    for linear in experts.modules():
        if isinstance(linear, QuantizedLinear):
            linear.cpu_kernels = kernels
    out = experts.matmul(1, x)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.cat([expected, expected], dim=-1).float())


def test_weight_only_experts_take_float32_inputs():
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = _identity_experts("none").matmul(0, x)
    assert out.dtype == torch.float32 and torch.equal(out, torch.cat([x, x], dim=-1).float())
