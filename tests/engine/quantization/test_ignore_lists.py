"""Modules a checkpoint leaves unquantized, matched as the format's own library matches
its ignore list: compressed-tensors' ``ignore`` (exact names, "re:" patterns from the
start), transformers' ``modules_to_not_convert`` (names and regexes such as gpt-oss's
``model.layers.*.self_attn`` up to a module boundary, or suffixes)."""

from __future__ import annotations

import pytest

from shardline import LLM, SamplingParams
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.quantization.linear import QuantizedLinear
from shardline.engine.quantization.scheme import QuantScheme

from ..hf_reference import hf_greedy
from . import checkpoints as ckpt

COMPRESSED = QuantScheme("compressed-tensors", "int4", "packed",
                         ignore=("lm_head", "re:.*mlp\\.gate$", "re:model\\.layers\\.0\\."))
GPT_OSS = QuantScheme("mxfp4", "mxfp4", "float",
                      ignore=("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"))


@pytest.mark.parametrize(("scheme", "module", "ignored"), [
    (COMPRESSED, "lm_head", True),
    (COMPRESSED, "model.lm_head", False),  # compressed-tensors: a plain entry is an exact name
    (COMPRESSED, "model.layers.3.mlp.gate", True),
    (COMPRESSED, "model.layers.3.mlp.gate_proj", False),
    (COMPRESSED, "model.layers.0.self_attn.q_proj", True),  # "re:" matches from the start
    (COMPRESSED, "model.layers.10.self_attn.q_proj", False),
    (GPT_OSS, "model.layers.3.self_attn.q_proj", True),  # "*" up to a module boundary
    (GPT_OSS, "model.layers.3.self_attn", True),
    (GPT_OSS, "model.layers.3.self_attn_norm", False),
    (GPT_OSS, "model.layers.12.mlp.router", True),
    (GPT_OSS, "model.layers.12.mlp.experts", False),
    (GPT_OSS, "lm_head", True),
    (QuantScheme("fp8", "fp8", "w8", ignore=("down_proj",)), "model.layers.1.mlp.down_proj", True),  # a suffix
    (QuantScheme("fp8", "fp8", "w8"), "lm_head", False),
])
def test_ignore_lists_match_as_the_formats_write_them(scheme, module, ignored) -> None:
    assert scheme.ignores(module) is ignored


@pytest.mark.parametrize("fmt", ["fp8_glob", "compressed_regex"])
def test_modules_a_pattern_ignores_run_float_through_the_engine(tmp_path, fmt) -> None:
    """Every layer's attention left float by one pattern, the MLPs quantized: greedy
    tokens as the float model with the MLPs' dequantized weights."""
    float_dir = build_tiny_model(tmp_path / "float", "llama")
    if fmt == "fp8_glob":
        config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [32, 32],
                  "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
        quantize = ckpt.fp8_blocks((32, 32))
    else:
        config = ckpt.compressed_config("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True,
                                                           "strategy": "group", "group_size": 32},
                                        ignore=("lm_head", "re:.*self_attn\\.[qkvo]_proj$"))
        quantize = ckpt.pack_quantized(32, True)
    out_dir = tmp_path / fmt
    dequantized = ckpt.write_quantized(float_dir, out_dir, config, quantize,
                                       modules=lambda names: [name for name in names if ".self_attn." not in name])
    assert dequantized and all(".mlp." in name for name in dequantized)
    prompts = [[5, 9, 33, 70, 100, 7, 8, 200], [6, 10, 34, 71, 101, 7, 8, 200]]
    reference = ckpt.reference_model(float_dir, dequantized)
    expected = [hf_greedy(reference, prompt, 10) for prompt in prompts]
    assert expected[0] != expected[1]  # the tokens depend on the input
    llm = LLM(str(out_dir), dtype="float32", device="cpu")
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                           SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    # The engine wraps each decoder layer (``.layer.``) and a stacked MLP (``.mlp.mlp.``, its
    # gate and up views of one stacked ``gate_up``); the ignored attention stays nn.Linear.
    quantized = {name.replace(".layer.", ".").replace(".mlp.mlp.", ".mlp.")
                 for name, module in ckpt.engine_model(llm).named_modules()
                 if isinstance(module, QuantizedLinear) and not name.endswith(".gate_up")}
    assert quantized == set(dequantized)
