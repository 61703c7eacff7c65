"""Each quantized checkpoint format, built locally in its on-disk layout, runs token for
token as transformers' generate of the same model with the weights dequantized
(float32), and stays quantized in memory.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from shardline import LLM, SamplingParams
from shardline.engine.kernels.cpu_quant_int8 import cpu_w8a8_available
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.quantization.linear import QuantizedLinear, quantized_linears

from ..hf_reference import hf_greedy, random_prompts
from . import checkpoints as ckpt

MAX_NEW_TOKENS = 8
FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
STACKED_GROUPS = ("stacked_qkv", "gate_up")  # the stacked groups' names in their modules
PROMPTS = random_prompts(6, (2, 40), 512, seed=3)


def _gptq_config(**overrides):
    return {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
            "checkpoint_format": "gptq", **overrides}


_INT4_GROUPS = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
# name: (architecture, quantization_config, quantizer, in-memory weight dtype)
FORMATS = {
    "fp8_per_tensor_static": ("llama", {"quant_method": "fp8", "activation_scheme": "static"},
                              ckpt.fp8_per_tensor(), torch.float8_e4m3fn),
    "fp8_blocks_scale_inv": ("qwen3", {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                       "weight_block_size": [32, 32]}, ckpt.fp8_blocks((32, 32)), torch.float8_e4m3fn),
    "fp8_partial_blocks": ("llama", {"quant_method": "fp8", "weight_block_size": [48, 48]},
                           ckpt.fp8_blocks((48, 48), "weight_scale"), torch.float8_e4m3fn),
    "compressed_fp8_w8a8_channel": (
        "qwen3", ckpt.compressed_config(
            "float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}),
        ckpt.fp8_per_channel, torch.float8_e4m3fn),
    "fbgemm_fp8_channel": ("llama", {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                     "modules_to_not_convert": ["lm_head"]}, ckpt.fp8_per_channel, torch.float8_e4m3fn),
    "compressed_fp8_blocks": (
        "llama", ckpt.compressed_config("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True,
                                                            "strategy": "block", "block_structure": [32, 64]}),
        ckpt.fp8_blocks((32, 64), "weight_scale"), torch.float8_e4m3fn),
    "compressed_int8_w8a8_channel": (
        "llama", ckpt.compressed_config(
            "int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
        ckpt.int8_per_channel, torch.int8),
    "compressed_int8_asymmetric_channel": (
        "qwen2", ckpt.compressed_config(
            "int-quantized", {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}),
        ckpt.int8_asymmetric(per_channel=True), torch.int8),
    "compressed_int8_asymmetric_tensor_w8a8": (
        "llama", ckpt.compressed_config(
            "int-quantized", {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor"},
            {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
        ckpt.int8_asymmetric(per_channel=False), torch.int8),
    "compressed_int8_groups": ("llama", ckpt.int8_groups_config(32), ckpt.int8_groups(32), torch.int8),
    "compressed_int8_asymmetric_groups": ("llama", ckpt.int8_groups_config(32, symmetric=False),
                                          ckpt.int8_groups_asymmetric(32), torch.int8),
    # pack-quantized num_bits 8: llm-compressor's W8A16 preset (symmetric, per channel), and by groups
    "compressed_w8a16_channel": ("qwen3", ckpt.pack_quantized_int8_config(None, True),
                                 ckpt.pack_quantized_int8(None, True), torch.int8),
    "compressed_w8a16_asymmetric_groups": ("qwen2", ckpt.pack_quantized_int8_config(32, False),
                                           ckpt.pack_quantized_int8(32, False), torch.int8),
    "compressed_w4a16_symmetric": (
        "qwen3", ckpt.compressed_config("pack-quantized", {**_INT4_GROUPS, "symmetric": True}),
        ckpt.pack_quantized(32, True), torch.uint8),
    "compressed_w4a16_asymmetric_act_order": (
        "llama", ckpt.compressed_config("pack-quantized", {**_INT4_GROUPS, "symmetric": False, "actorder": "group"}),
        ckpt.pack_quantized(32, False, act_order=True), torch.uint8),
    "gptq_v1_symmetric": ("llama", _gptq_config(), ckpt.gptq(32, True), torch.uint8),
    "gptq_v1_desc_act": ("qwen3", _gptq_config(desc_act=True, sym=False), ckpt.gptq(32, False, act_order=True),
                         torch.uint8),
    "gptq_v2": ("llama", _gptq_config(checkpoint_format="gptq_v2", sym=False), ckpt.gptq(32, False, version="gptq_v2"),
                torch.uint8),
    "gptq_8bit": ("llama", _gptq_config(bits=8), ckpt.gptq_8bit(32), torch.int8),
    "gptq_8bit_desc_act": ("qwen3", _gptq_config(bits=8, desc_act=True), ckpt.gptq_8bit(32, act_order=True),
                           torch.int8),
    "gptq_tied_embeddings": ("qwen3_tied", _gptq_config(), ckpt.gptq(32, True), torch.uint8),
    "awq_gemm_with_biases": ("qwen2", {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                       "version": "gemm"}, ckpt.awq(32), torch.uint8),
    "fp8_channel_with_biases": ("qwen2", {"quant_method": "fp8", "activation_scheme": "dynamic"},
                                ckpt.fp8_per_channel, torch.float8_e4m3fn),
    "awq_gemm": ("qwen3", {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
                 ckpt.awq(32), torch.uint8),
}


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    """One tiny float checkpoint per architecture."""
    dirs = {arch: build_tiny_model(tmp_path_factory.mktemp(f"float-{arch}"), arch)
            for arch in ("llama", "qwen3", "qwen2")}  # qwen2: biases on its query, key and value projections
    dirs["qwen3_tied"] = build_tiny_model(tmp_path_factory.mktemp("float-qwen3-tied"), "qwen3",
                                          tie_word_embeddings=True)
    return dirs


def _engine_tokens(model_dir, prompts=PROMPTS, **options):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", **options)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
    return llm, [output.outputs[0].token_ids for output in outputs]


def assert_kept_quantized(model: nn.Module, modules: list[str], dtype: torch.dtype) -> None:
    """Every quantized module is a QuantizedLinear holding ``dtype`` codes and no float weight."""
    # The CPU path's fused decoder layers keep the original layer as their ``layer``, its
    # stacked MLPs the original MLP as their ``mlp``; a stacked group (quantization/stacked.py)
    # holds its parts' codes, which are views of it.
    layers = dict(quantized_linears(model))
    found = {name.replace(".layer.", ".").replace(".mlp.mlp.", ".mlp."): layer for name, layer in layers.items()
             if name.rsplit(".", 1)[-1] not in STACKED_GROUPS}
    assert sorted(found) == sorted(modules)
    for layer in layers.values():
        stored = layer.weight if layer.layout == "w8" else layer.packed
        assert stored is not None and stored.dtype == dtype
        floats = [name for name, tensor in layer.named_buffers() if tensor.dtype in FLOAT_DTYPES
                  and tensor.numel() >= layer.in_features * layer.out_features // 4]
        assert not floats, floats  # scales only: no float copy of the weight
        assert not isinstance(layer, nn.Linear)


def _quantizes_inputs(config) -> bool:
    """Whether the checkpoint's own forward quantizes the linears' inputs (compressed-tensors W8A8)."""
    return any(group.get("input_activations") for group in config.get("config_groups", {}).values())


# A W8A8 comparison's prompts: those whose greedy path through the reference has no
# two leading logits closer than this. Quantizing inputs is discontinuous: a last-bit
# difference (transformers' own cached decode against its full forward, too) can move
# one element across a rounding boundary, which decides only near-ties.
W8A8_MARGIN = 0.02


def clear_prompts(reference: transformers.PreTrainedModel, prompts: list[list[int]]) -> list[list[int]]:
    """The prompts whose reference greedy path never passes a near-tie (W8A8_MARGIN)."""
    kept = []
    for prompt in prompts:
        tokens = hf_greedy(reference, prompt, MAX_NEW_TOKENS)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
        top = logits.topk(2).values
        if bool(((top[:, 0] - top[:, 1]) > W8A8_MARGIN).all()):
            kept.append(prompt)
    return kept


# Formats whose fast representative runs elsewhere: test_asymmetric_kernels.py runs
# compressed_w8a16_asymmetric_groups (the same in-memory layers) on the C kernels.
SLOW_FORMATS = ("compressed_int8_asymmetric_groups", "compressed_w8a16_asymmetric_groups")


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_FORMATS else name
                                  for name in sorted(FORMATS)])
def test_format_matches_dequantized_transformers(name, float_dirs, tmp_path):
    """W8A8 checkpoints against transformers' own load of them (compressed-tensors
    quantizes each linear's input per token, and the engine does the same), over the
    prompts without near-ties; the rest against the float model with the dequantized
    weights."""
    arch, config, quantize, dtype = FORMATS[name]
    dequantized = ckpt.write_quantized(float_dirs[arch], tmp_path / name, config, quantize)
    prompts = PROMPTS
    if _quantizes_inputs(config):
        reference = ckpt.transformers_own_model(tmp_path / name)
        prompts = clear_prompts(reference, PROMPTS)
        assert len(prompts) >= len(PROMPTS) // 2
    else:
        reference = ckpt.reference_model(float_dirs[arch], dequantized)
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    llm, tokens = _engine_tokens(tmp_path / name, prompts)
    assert tokens == expected
    inputs = {layer.input_quantization for _, layer in quantized_linears(ckpt.engine_model(llm))}
    assert inputs == ({"int8" if dtype == torch.int8 else "fp8"} if _quantizes_inputs(config) else {"none"})
    assert_kept_quantized(ckpt.engine_model(llm), list(dequantized), dtype)


def test_reference_tokens_depend_on_the_input(float_dirs, tmp_path):
    """The tiny models' greedy tokens change with the prompt, so the comparisons test something."""
    dequantized = ckpt.write_quantized(float_dirs["llama"], tmp_path / "gptq", _gptq_config(), ckpt.gptq(32, True))
    reference = ckpt.reference_model(float_dirs["llama"], dequantized)
    outputs = {tuple(hf_greedy(reference, prompt, MAX_NEW_TOKENS)) for prompt in PROMPTS}
    assert len(outputs) == len(PROMPTS)


def test_fp8_blocks_match_transformers_own_fp8_loader(float_dirs, tmp_path):
    """A second, independent reference: transformers' own FP8 loader (it dequantizes
    block FP8 to the load dtype on CPU) generates the same tokens."""
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    ckpt.write_quantized(float_dirs["llama"], tmp_path / "fp8", config, ckpt.fp8_blocks((32, 32)))
    try:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "fp8"), dtype=torch.float32, attn_implementation="eager").eval()
    except Exception as error:  # noqa: BLE001 - transformers' FP8 path may want a GPU or a kernel download
        pytest.skip(f"transformers' FP8 loader does not load on this host: {error}")
    expected = [hf_greedy(theirs, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    _, tokens = _engine_tokens(tmp_path / "fp8")
    assert tokens == expected


def test_ignored_modules_stay_float(float_dirs, tmp_path):
    """Modules the config's ignore list names are stored and run unquantized."""
    kept = "model.layers.1.mlp.down_proj"
    config = ckpt.compressed_config("pack-quantized", {**_INT4_GROUPS, "symmetric": True}, ignore=("lm_head", kept))
    dequantized = ckpt.write_quantized(float_dirs["llama"], tmp_path / "ignore", config, ckpt.pack_quantized(32, True),
                                       modules=lambda names: [n for n in names if n != kept])
    reference = ckpt.reference_model(float_dirs["llama"], dequantized)
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    llm, tokens = _engine_tokens(tmp_path / "ignore")
    assert tokens == expected
    model = ckpt.engine_model(llm)
    assert_kept_quantized(model, list(dequantized), torch.uint8)
    assert not any(isinstance(module, QuantizedLinear) for name, module in model.named_modules()
                   if name.replace(".layer.", ".") == kept)


@pytest.mark.parametrize("name", ["fp8_blocks_scale_inv", "gptq_v1_desc_act", "compressed_int8_w8a8_channel",
                                  pytest.param("compressed_w8a16_asymmetric_groups", marks=pytest.mark.slow)])
def test_bfloat16_serving_passes_the_load_check(name, float_dirs, tmp_path):
    """Served in bfloat16 (the CPU kernels' bfloat16 paths), a quantized model passes the
    load check against its dequantized reference and stays quantized."""
    arch, config, quantize, dtype = FORMATS[name]
    dequantized = ckpt.write_quantized(float_dirs[arch], tmp_path / name, config, quantize)
    llm = LLM(str(tmp_path / name), dtype="bfloat16", device="cpu")
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
    assert all(len(output.outputs[0].token_ids) == MAX_NEW_TOKENS for output in outputs)
    assert_kept_quantized(ckpt.engine_model(llm), list(dequantized), dtype)


@pytest.mark.parametrize("setting", ["on", "off"])
def test_w8a8_int8_with_the_integer_kernel_path_on_and_off(setting, float_dirs, tmp_path, monkeypatch):
    """SHARDLINE_CPU_PATHS=quant_int8_kernel=on|off: integer products (where the host has
    AVX512_VNNI) or the weight-only kernels on the dequantized codes; the same tokens as
    transformers' own load of the checkpoint either way."""
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", f"quant_int8_kernel={setting}")
    arch, config, quantize, _ = FORMATS["compressed_int8_w8a8_channel"]
    ckpt.write_quantized(float_dirs[arch], tmp_path / "w8a8", config, quantize)
    reference = ckpt.transformers_own_model(tmp_path / "w8a8")
    prompts = clear_prompts(reference, PROMPTS)
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    llm, tokens = _engine_tokens(tmp_path / "w8a8", prompts)
    assert tokens == expected
    taken = setting == "on" and cpu_w8a8_available(torch.float32)
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    assert engine.cpu_paths.quant_int8_kernel == taken
    assert {layer.int8_kernel for _, layer in quantized_linears(ckpt.engine_model(llm))} == {taken}
