"""compressed-tensors int8 with group scales (``strategy: "group"``, ``weight_scale``
[N, K / group_size]) runs as W8 blocks of one row by a group: greedy tokens equal
transformers' own compressed-tensors forward of the checkpoint, on the CPU C kernels."""

from __future__ import annotations

import pytest
import torch

from shardline.engine.kernels.cpu_quant import cpu_quant_available
from shardline.engine.quantization.linear import quantized_linears

from ..cpu.paths_taken import taken_unless_forced_off
from ..hf_reference import hf_greedy
from . import checkpoints as ckpt
from .test_formats import FORMATS, MAX_NEW_TOKENS, PROMPTS, _engine_tokens, float_dirs  # noqa: F401 - the fixture


@pytest.mark.slow  # the fast representative: test_formats.py's compressed_int8_groups
@pytest.mark.skipif(not cpu_quant_available(), reason="the quantized C kernels do not build here")
@taken_unless_forced_off("quant_kernels")
def test_int8_groups_match_transformers_own_forward(float_dirs, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "quant_kernels=on")
    arch, config, quantize, _ = FORMATS["compressed_int8_groups"]
    ckpt.write_quantized(float_dirs[arch], tmp_path / "groups", config, quantize)
    reference = ckpt.transformers_own_model(tmp_path / "groups")
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    llm, tokens = _engine_tokens(tmp_path / "groups")
    assert tokens == expected
    layers = [layer for _, layer in quantized_linears(ckpt.engine_model(llm))]
    assert layers and all(layer.block == (1, 32) and layer.cpu_kernels for layer in layers)
    assert all(layer.weight is not None and layer.weight.dtype == torch.int8 for layer in layers)
