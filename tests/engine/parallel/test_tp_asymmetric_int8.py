"""Asymmetric int8 checkpoints (compressed-tensors ``symmetric: false``) over 2
tensor-parallel ranks (gloo): each rank reads its share of the weights with their zero
points (column shares cut by output rows, row shares by whole groups of input columns),
and 2 ranks give 1 rank's and transformers' greedy tokens, on the CPU C kernels with
q/k/v and gate/up stacked. Pack-quantized W8A16 (8-bit codes four to an int32, zero
points packed along the output rows) with asymmetric groups is the fast case: it covers
the packed words' and the group zero points' cuts at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.parallel.quantized import RowParallelQuantized
from shardline.engine.quantization.linear import quantized_linears

from ..cpu.paths_taken import taken_unless_forced_off
from ..hf_reference import hf_greedy
from ..quantization import checkpoints as ckpt
from ..quantization.test_formats import FORMATS, MAX_NEW_TOKENS, PROMPTS, _quantizes_inputs, clear_prompts
from .test_quantized import OPTIONS


def ranks_give_the_references_tokens(name: str, sizes: tuple[int, ...], tmp_path: Path) -> None:
    """Checkpoint ``name`` of FORMATS on each of ``sizes`` ranks gives transformers'
    greedy tokens (of the dequantized model; its own forward for W8A8), every linear
    asymmetric on the C kernels; on 2 ranks the row shares keep zero points of their
    scale's shape and q/k/v and gate/up are stacked."""
    arch, config, quantize, _ = FORMATS[name]
    float_dir = build_tiny_model(tmp_path / "float", arch)
    dequantized = ckpt.write_quantized(float_dir, tmp_path / name, config, quantize)
    if _quantizes_inputs(config):  # W8A8: transformers' own forward, prompts without near-ties
        reference = ckpt.transformers_own_model(tmp_path / name)
        prompts = clear_prompts(reference, PROMPTS)
        assert len(prompts) >= 3
    else:
        reference, prompts = ckpt.reference_model(float_dir, dequantized), PROMPTS
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    assert len({tuple(tokens) for tokens in expected}) > 1
    for size in sizes:
        llm = LLM(str(tmp_path / name), tensor_parallel_size=size, **OPTIONS)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0), use_tqdm=False)
            assert [list(output.outputs[0].token_ids) for output in outputs] == expected, size
            model = ckpt.engine_model(llm)
            layers = [layer for _, layer in quantized_linears(model)]
            assert layers and all(layer.zero is not None and layer.cpu_kernels for layer in layers)
            if size == 2:
                rows = [module.linear for module in model.modules() if isinstance(module, RowParallelQuantized)]
                assert rows and all(row.zero is not None and row.scale is not None
                                    and row.zero.shape == row.scale.shape for row in rows)
                assert any(name.endswith(("stacked_qkv", "gate_up")) for name, _ in quantized_linears(model))
        finally:
            llm.close()


@taken_unless_forced_off("quant_kernels")
def test_packed_8bit_asymmetric_groups_on_two_ranks(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "quant_kernels=on")  # the ranks inherit it
    ranks_give_the_references_tokens("compressed_w8a16_asymmetric_groups", (2,), tmp_path)


@pytest.mark.slow  # the fast representatives: the test above, test_tp_loading_quantized.py's slice and split checks
@taken_unless_forced_off("quant_kernels")
@pytest.mark.parametrize("name", ["compressed_int8_asymmetric_channel", "compressed_int8_asymmetric_tensor_w8a8",
                                  "compressed_int8_asymmetric_groups", "compressed_w8a16_asymmetric_groups"])
def test_asymmetric_int8_on_two_ranks_gives_one_ranks_tokens(name, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "quant_kernels=on")  # the ranks inherit it
    ranks_give_the_references_tokens(name, (1, 2), tmp_path)
