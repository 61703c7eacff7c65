"""compressed-tensors linears read by the engine dequantize to what the compressed-tensors
package's own compressors decompress from the same tensors (the code transformers runs
to load such a checkpoint); 8-bit pack-quantized and asymmetric int8 groups also give
transformers' own forward's greedy tokens (slow)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import save_file

from shardline.engine.kernels.cpu_quant import cpu_quant_available
from shardline.engine.quantization.checkpoint import CheckpointTensors
from shardline.engine.quantization.compressed import parse_compressed_tensors
from shardline.engine.quantization.formats import read_quantized_linear
from shardline.engine.quantization.linear import quantized_linears

from ..cpu.paths_taken import taken_unless_forced_off
from ..hf_reference import hf_greedy
from . import checkpoints as ckpt
from .test_formats import FORMATS, MAX_NEW_TOKENS, PROMPTS, _engine_tokens, float_dirs  # noqa: F401 - the fixture

_INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
# name: (quantization_config, quantizer, the layer's in-memory layout)
CASES: dict[str, tuple[dict[str, Any], Callable, str]] = {
    "w8a16_channel": (ckpt.pack_quantized_int8_config(None, True), ckpt.pack_quantized_int8(None, True), "w8"),
    "w8a16_channel_asymmetric": (ckpt.pack_quantized_int8_config(None, False), ckpt.pack_quantized_int8(None, False),
                                 "w8"),
    "w8a16_groups_asymmetric": (ckpt.pack_quantized_int8_config(32, False), ckpt.pack_quantized_int8(32, False),
                                "w8"),
    "w4a16_groups_asymmetric": (ckpt.compressed_config("pack-quantized", {**_INT4, "symmetric": False}),
                                ckpt.pack_quantized(32, False), "w4"),
    "int8_groups_asymmetric": (ckpt.int8_groups_config(32, symmetric=False), ckpt.int8_groups_asymmetric(32), "w8"),
}
# Output rows not a whole packed word of 4-bit (8) or 8-bit (4) zero points.
SHAPE = (44, 96)


def _library_weight(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight compressed-tensors' compressor for the config's format decompresses."""
    parsed = QuantizationConfig.model_validate(config)
    scheme = parsed.config_groups["group_0"]
    compressor = BaseCompressor.load_from_registry(scheme.format or parsed.format)
    state = {name: tensor.float() if name == "weight_scale" else tensor for name, tensor in tensors.items()}
    return compressor.decompress(state, scheme)["weight"].float()


@pytest.mark.parametrize("name", sorted(CASES))
def test_read_linear_equals_the_library_decompression(name, tmp_path):
    config, quantize, layout = CASES[name]
    weight = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5)) * 0.2
    tensors, _ = quantize("m", weight)
    save_file({f"m.{key}": value.contiguous() for key, value in tensors.items()}, str(tmp_path / "model.safetensors"))
    layer = read_quantized_linear(CheckpointTensors(tmp_path), "m", parse_compressed_tensors(config), SHAPE,
                                  torch.float32)
    assert layer.layout == layout
    if layout == "w8":
        assert layer.weight is not None and layer.weight.dtype == torch.int8
        asymmetric = not config["config_groups"]["group_0"]["weights"]["symmetric"]
        assert (layer.zero is not None and layer.zero.dtype == torch.int8) == asymmetric
    expected = _library_weight(config, tensors)
    assert float((expected - weight).abs().max()) < 0.05  # the library reads what was quantized
    torch.testing.assert_close(layer.dequantized_rows(0, SHAPE[0]), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # the fast representatives: the reader test above, test_formats.py's compressed_w8a16_channel
@pytest.mark.parametrize("name", ["compressed_w8a16_channel", "compressed_int8_asymmetric_groups"])
@pytest.mark.skipif(not cpu_quant_available(), reason="the quantized C kernels do not build here")
@taken_unless_forced_off("quant_kernels")
def test_matches_transformers_own_forward(name, float_dirs, tmp_path, monkeypatch):  # noqa: F811
    """Greedy tokens equal transformers' own compressed-tensors load of the checkpoint, on
    the C kernels. (Asymmetric pack-quantized checkpoints are not loaded by transformers
    with compressed-tensors 0.20: it expects their zero points unpacked; the reader test
    compares them with the library's own decompression instead.)"""
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "quant_kernels=on")
    arch, config, quantize, _ = FORMATS[name]
    ckpt.write_quantized(float_dirs[arch], tmp_path / name, config, quantize)
    reference = ckpt.transformers_own_model(tmp_path / name)
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    llm, tokens = _engine_tokens(tmp_path / name)
    assert tokens == expected
    layers = [layer for _, layer in quantized_linears(ckpt.engine_model(llm))]
    assert layers and all(layer.cpu_kernels and layer.weight is not None and layer.weight.dtype == torch.int8
                          for layer in layers)
