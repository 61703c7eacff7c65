"""The CPU MXFP4 matmul (cpu_mxfp4.c) against quant_reference.py's dequantization, for
each target the host can build (native, AVX2, the SSE2 baseline: kernel_target)."""

from __future__ import annotations

import pytest
import torch

from shardline.engine.kernels.cpu_mxfp4 import cpu_mxfp4_available, cpu_mxfp4_dequantize, cpu_mxfp4_matmul
from shardline.engine.kernels.quant_reference import dequantize_mxfp4

pytestmark = pytest.mark.skipif(not cpu_mxfp4_available(), reason="no C compiler builds cpu_mxfp4.c here")

EXPONENTS = torch.exp2(torch.arange(256, dtype=torch.float32) - 127.0)


def _weight(rows: int, groups: int, seed: int, scale_range: tuple[int, int] = (112, 136)):
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, groups, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(*scale_range, (rows, groups), generator=generator, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("m_rows", [1, 3, 8, 9, 16, 21])  # past KERNEL_MAX_ROWS (16): dequantized panels
def test_matmul_matches_the_reference(kernel_target, m_rows) -> None:
    blocks, scales = _weight(37, 3, seed=m_rows)  # 37 output rows, K = 96
    x = torch.randn(m_rows, 96, generator=torch.Generator().manual_seed(1))
    expected = x @ dequantize_mxfp4(blocks, scales).t()
    actual = cpu_mxfp4_matmul(x, blocks, scales, EXPONENTS)
    assert actual.shape == (m_rows, 37)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("m_rows", [4, 40])
def test_bfloat16_activations(m_rows) -> None:
    blocks, scales = _weight(37, 3, seed=m_rows)
    x = torch.randn(m_rows, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = x.float() @ dequantize_mxfp4(blocks, scales).t()
    actual = cpu_mxfp4_matmul(x, blocks, scales, EXPONENTS)
    # The panel path rounds its product to bfloat16 once (transformers' bfloat16 experts do too).
    tolerance = (1e-5 if m_rows <= 16 else 1e-2) * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=1e-2, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_is_the_reference_bit_for_bit(kernel_target, dtype) -> None:
    # Every code and the extreme scales: 2^-127 (a float32 subnormal) up to 2^127; each
    # value is exact in bfloat16 too.
    blocks, scales = _weight(64, 5, seed=3, scale_range=(0, 255))
    reference = dequantize_mxfp4(blocks, scales)
    assert torch.equal(reference.to(dtype).float(), reference)
    assert torch.equal(cpu_mxfp4_dequantize(blocks, scales, EXPONENTS, dtype), reference.to(dtype))


def test_a_wide_matmul_splits_over_threads(kernel_target) -> None:
    blocks, scales = _weight(700, 4, seed=5)  # past the single-thread bound
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    expected = x @ dequantize_mxfp4(blocks, scales).t()
    torch.testing.assert_close(cpu_mxfp4_matmul(x, blocks, scales, EXPONENTS), expected, rtol=1e-5,
                               atol=1e-5 * float(expected.abs().max()))


def test_the_launcher_refuses_a_layout_it_does_not_take() -> None:
    blocks, scales = _weight(8, 2, seed=0)
    with pytest.raises(AssertionError, match="x"):
        cpu_mxfp4_matmul(torch.randn(2, 96), blocks, scales, EXPONENTS)  # K = 96 against 2 groups of 32
    with pytest.raises(AssertionError):
        cpu_mxfp4_matmul(torch.randn(2, 64).half(), blocks, scales, EXPONENTS)
