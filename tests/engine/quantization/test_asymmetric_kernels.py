"""Asymmetric int8 checkpoints (compressed-tensors ``symmetric: false``: zero points per
tensor, channel or group, int-quantized or 8-bit pack-quantized) on the CPU C kernels:
greedy tokens equal transformers', and every quantized linear's product goes through
cpu_quant.c with its zero points, never the torch tile path."""

from __future__ import annotations

import pytest

from shardline.engine.kernels.cpu_quant import cpu_quant_available
from shardline.engine.quantization import linear as quantized_linear
from shardline.engine.quantization.linear import quantized_linears

from ..cpu.paths_taken import taken_unless_forced_off
from . import checkpoints as ckpt
from .test_formats import (  # noqa: F401 - float_dirs: the fixture
    FORMATS,
    MAX_NEW_TOKENS,
    PROMPTS,
    _engine_tokens,
    _quantizes_inputs,
    clear_prompts,
    float_dirs,
    hf_greedy,
)

pytestmark = pytest.mark.skipif(not cpu_quant_available(), reason="the quantized C kernels do not build here")


@taken_unless_forced_off("quant_kernels")
@pytest.mark.parametrize("name", ["compressed_int8_asymmetric_channel", "compressed_w8a16_asymmetric_groups",
                                  pytest.param("compressed_int8_asymmetric_tensor_w8a8", marks=pytest.mark.slow),
                                  pytest.param("compressed_int8_asymmetric_groups", marks=pytest.mark.slow)])
def test_asymmetric_int8_runs_the_c_kernels(name, float_dirs, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "quant_kernels=on")
    calls = {"kernel": 0}
    kernel = quantized_linear.cpu_w8_linear

    def counted(*args, zero=None, **kwargs):
        assert zero is not None  # every layer of these checkpoints is asymmetric
        calls["kernel"] += 1
        return kernel(*args, zero=zero, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("an asymmetric layer took the torch tile path")

    monkeypatch.setattr(quantized_linear, "cpu_w8_linear", counted)
    monkeypatch.setattr(quantized_linear, "torch_quantized_matmul", refused)
    arch, config, quantize, _ = FORMATS[name]
    dequantized = ckpt.write_quantized(float_dirs[arch], tmp_path / name, config, quantize)
    if _quantizes_inputs(config):
        reference = ckpt.transformers_own_model(tmp_path / name)
        prompts = clear_prompts(reference, PROMPTS)
    else:
        reference, prompts = ckpt.reference_model(float_dirs[arch], dequantized), PROMPTS
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    llm, tokens = _engine_tokens(tmp_path / name, prompts)
    assert tokens == expected
    layers = [layer for _, layer in quantized_linears(ckpt.engine_model(llm))]
    assert layers and all(layer.zero is not None and layer.cpu_kernels for layer in layers)
    assert calls["kernel"] >= MAX_NEW_TOKENS  # a decode step or more
