"""Tiny quantized checkpoints built locally in each format's on-disk layout, and the
float32 transformers model with the same weights dequantized (the reference).

A tiny random model (engine/model/tiny.py, weights N(0, 0.2)) is written once; each
builder quantizes its decoder linears itself (the lm_head and embeddings stay
float), writes the format's tensors and quantization_config beside the float ones,
and returns the dequantized weights by module, computed from the integer codes and
scales it wrote (not by reading the files back), so the reference is independent of
the engine's readers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from compressed_tensors.compressors import pack_to_int32
from safetensors.torch import load_file, save_file

from shardline import LLM
from shardline.engine.llm_engine import LLMEngine

FP8_MAX = 448.0
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of each word holds column AWQ_ORDER[i]
Written = tuple[dict[str, torch.Tensor], torch.Tensor]  # (tensors on disk, dequantized weight)


def decoder_linears(state: dict[str, torch.Tensor]) -> list[str]:
    """The decoder layers' linear modules of a float checkpoint (lm_head aside)."""
    return sorted(name[: -len(".weight")] for name, tensor in state.items()
                  if ".layers." in name and name.endswith("_proj.weight") and tensor.dim() == 2)


def write_quantized(float_dir: str | Path, out_dir: str | Path, quantization_config: dict[str, Any],
                    quantize: Callable[[str, torch.Tensor], Written],
                    modules: Callable[[list[str]], list[str]] = lambda names: names) -> dict[str, torch.Tensor]:
    """Copy ``float_dir`` to ``out_dir`` with ``modules`` of its decoder linears replaced by
    ``quantize(name, weight)``'s tensors; return the dequantized weights by module."""
    float_dir, out_dir = Path(float_dir), Path(out_dir)
    shutil.copytree(float_dir, out_dir, dirs_exist_ok=True)
    state = load_file(str(float_dir / "model.safetensors"))
    dequantized = {}
    for module in modules(decoder_linears(state)):
        tensors, weight = quantize(module, state.pop(f"{module}.weight").float())
        state.update({f"{module}.{name}": tensor.contiguous() for name, tensor in tensors.items()})
        dequantized[module] = weight
    save_file(state, str(out_dir / "model.safetensors"))
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized


def reference_model(float_dir: str | Path, dequantized: dict[str, torch.Tensor],
                    dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """The float model of ``float_dir`` with ``dequantized`` weights in place (eager attention)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=dtype,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        for module, weight in dequantized.items():
            linear = model.get_submodule(module)
            assert isinstance(linear, torch.nn.Linear), module
            linear.weight.copy_(weight)
    return model


def transformers_own_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """The checkpoint as transformers itself loads and runs it (compressed-tensors'
    forward: the weights decompressed, a W8A8 scheme's inputs quantized per token)."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                              attn_implementation="eager").eval()


def engine_model(llm: LLM) -> torch.nn.Module:
    """The model an LLM's generation engine runs."""
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    return engine.model


# Per format: (name, weight [N, K] float32) -> (tensors as the format stores them, dequantized weight).

def fp8_per_tensor(scale_name: str = "weight_scale") -> Callable[[str, torch.Tensor], Written]:
    def quantize(name: str, weight: torch.Tensor) -> Written:
        scale = weight.abs().max() / FP8_MAX
        codes = (weight / scale).to(torch.float8_e4m3fn)
        return {"weight": codes, scale_name: scale.reshape(()), "input_scale": torch.tensor(0.05)}, \
            codes.float() * scale
    return quantize


def fp8_per_channel(name: str, weight: torch.Tensor) -> Written:
    scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
    codes = (weight / scale).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale.to(torch.bfloat16)}, codes.float() * scale.to(torch.bfloat16).float()


def fp8_blocks(block: tuple[int, int], scale_name: str = "weight_scale_inv") -> Callable[[str, torch.Tensor], Written]:
    def quantize(name: str, weight: torch.Tensor) -> Written:
        rows, cols = weight.shape
        br, bc = block
        scale = torch.empty(-(-rows // br), -(-cols // bc))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                scale[i, j] = weight[i * br:(i + 1) * br, j * bc:(j + 1) * bc].abs().max() / FP8_MAX
        expanded = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
        codes = (weight / expanded).to(torch.float8_e4m3fn)
        return {"weight": codes, scale_name: scale}, codes.float() * expanded
    return quantize


def int8_per_channel(name: str, weight: torch.Tensor) -> Written:
    scale = weight.abs().amax(dim=1, keepdim=True) / 127.0
    codes = (weight / scale).round().clamp(-127, 127).to(torch.int8)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale


def int8_asymmetric(per_channel: bool) -> Callable[[str, torch.Tensor], Written]:
    """compressed-tensors' asymmetric int8 (``symmetric: false``): codes -128..127 with
    an int8 ``weight_zero_point`` per output channel (or per tensor) beside the scale;
    w = (q - zero_point) * scale."""
    def quantize(name: str, weight: torch.Tensor) -> Written:
        low = weight.amin(dim=1, keepdim=True) if per_channel else weight.min().reshape(1, 1)
        high = weight.amax(dim=1, keepdim=True) if per_channel else weight.max().reshape(1, 1)
        # The range doubled above the largest weight: zero points far from 0 (about -64).
        scale = 2.0 * (high - low) / 255.0
        zero = (-128.0 - low / scale).round().clamp(-128, 127)
        codes = ((weight / scale).round() + zero).clamp(-128, 127)
        assert float((zero != 0).float().mean()) > 0.9
        stored = (-1, 1) if per_channel else (1,)  # compressed-tensors' shapes: [N, 1] or [1]
        tensors = {"weight": codes.to(torch.int8), "weight_scale": scale.reshape(stored),
                   "weight_zero_point": zero.to(torch.int8).reshape(stored)}
        return tensors, (codes - zero) * scale
    return quantize


def int8_groups(group_size: int) -> Callable[[str, torch.Tensor], Written]:
    """compressed-tensors' int8 with group scales (``strategy: "group"``): symmetric codes
    -127..127, ``weight_scale`` [N, K / group_size]."""
    def quantize(name: str, weight: torch.Tensor) -> Written:
        rows, cols = weight.shape
        groups = weight.reshape(rows, cols // group_size, group_size)
        scale = groups.abs().amax(dim=-1) / 127.0  # [N, K / g]
        expanded = scale.repeat_interleave(group_size, dim=1)
        codes = (weight / expanded).round().clamp(-127, 127)
        return {"weight": codes.to(torch.int8), "weight_scale": scale}, codes * expanded
    return quantize


def int8_codes(weight: torch.Tensor, group_size: int | None,
               symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(int8 codes [N, K], float32 scales [N, G], int8 zero points [N, G] or None when
    symmetric, the dequantized weight) of ``weight`` by groups of ``group_size`` input
    columns (None: one per output channel). Asymmetric: the range doubled above each
    group's largest weight, so zero points lie far from 0 (about -64)."""
    rows, cols = weight.shape
    group_size = group_size or cols
    groups = weight.reshape(rows, cols // group_size, group_size)
    if symmetric:
        scale, zero = groups.abs().amax(dim=-1) / 127.0, torch.zeros(rows, cols // group_size)
    else:
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = 2.0 * (high - low) / 255.0
        zero = (-128.0 - low / scale).round().clamp(-128, 127)
        assert float((zero != 0).float().mean()) > 0.9
    expanded_scale, expanded_zero = (table.repeat_interleave(group_size, dim=1) for table in (scale, zero))
    codes = ((weight / expanded_scale).round() + expanded_zero).clamp(-128 if not symmetric else -127, 127)
    dequantized = (codes - expanded_zero) * expanded_scale
    return codes.to(torch.int8), scale, None if symmetric else zero.to(torch.int8), dequantized


def int8_groups_asymmetric(group_size: int) -> Callable[[str, torch.Tensor], Written]:
    """compressed-tensors' asymmetric int8 by group (int-quantized): ``weight`` int8,
    ``weight_scale`` and int8 ``weight_zero_point`` [N, K / group_size]."""
    def quantize(name: str, weight: torch.Tensor) -> Written:
        codes, scale, zero, dequantized = int8_codes(weight, group_size, symmetric=False)
        assert zero is not None
        return {"weight": codes, "weight_scale": scale, "weight_zero_point": zero}, dequantized
    return quantize


def pack_quantized_int8(group_size: int | None, symmetric: bool) -> Callable[[str, torch.Tensor], Written]:
    """compressed-tensors' pack-quantized with num_bits 8 (llm-compressor's W8A16):
    int8 codes four to an int32 (packed by the compressed-tensors package), scales per
    channel [N, 1] or group [N, K / g], zero points packed along the output channels."""
    def quantize(name: str, weight: torch.Tensor) -> Written:
        rows, cols = weight.shape
        codes, scale, zero, dequantized = int8_codes(weight, group_size, symmetric)
        tensors = {"weight_packed": pack_to_int32(codes, 8), "weight_scale": scale,
                   "weight_shape": torch.tensor([rows, cols])}
        if zero is not None:
            tensors["weight_zero_point"] = pack_to_int32(zero, 8, packed_dim=0)
        return tensors, dequantized
    return quantize


def pack_quantized_int8_config(group_size: int | None, symmetric: bool) -> dict[str, Any]:
    """The quantization_config of an 8-bit pack-quantized checkpoint (weight-only)."""
    weights: dict[str, Any] = {"num_bits": 8, "type": "int", "symmetric": symmetric,
                               "strategy": "group" if group_size else "channel"}
    if group_size:
        weights["group_size"] = group_size
    config = compressed_config("pack-quantized", weights)
    config["config_groups"]["group_0"]["format"] = "pack-quantized"
    return config


def int8_groups_config(group_size: int, symmetric: bool = True) -> dict[str, Any]:
    """The quantization_config of an int8 checkpoint with group scales, its group's
    ``format`` "int-quantized" written out as llm-compressor writes it (without it,
    compressed-tensors infers pack-quantized for weight-only int8)."""
    config = compressed_config("int-quantized", {"num_bits": 8, "type": "int", "symmetric": symmetric,
                                                 "strategy": "group", "group_size": group_size})
    config["config_groups"]["group_0"]["format"] = "int-quantized"
    return config


def int4_groups(weight: torch.Tensor, group_size: int, symmetric: bool,
                column_group: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] 0..15, float16 scales [N, G], zero points [N, G] 0..15) of ``weight``,
    column k in group ``column_group[k]`` (k // group_size by default)."""
    rows, cols = weight.shape
    groups = cols // group_size
    column_group = torch.arange(cols) // group_size if column_group is None else column_group.long()
    scales = torch.empty(rows, groups)
    zeros = torch.empty(rows, groups)
    for group in range(groups):
        block = weight[:, column_group == group]
        if symmetric:
            scales[:, group] = block.abs().amax(dim=1) / 7.5
            zeros[:, group] = 8
        else:
            low, high = block.amin(dim=1).clamp(max=0), block.amax(dim=1).clamp(min=0)
            scales[:, group] = (high - low) / 15
            zeros[:, group] = (-low / scales[:, group]).round().clamp(0, 15)
    scales = scales.half()
    expand = scales.float()[:, column_group], zeros[:, column_group]
    codes = (weight / expand[0] + expand[1]).round().clamp(0, 15)
    return codes.to(torch.int32), scales, zeros.to(torch.int32)


def dequantized_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     column_group: torch.Tensor) -> torch.Tensor:
    return (codes.float() - zeros.float()[:, column_group.long()]) * scales.float()[:, column_group.long()]


def pack_quantized(group_size: int, symmetric: bool, act_order: bool = False) -> Callable[[str, torch.Tensor], Written]:
    """compressed-tensors' pack-quantized layout, packed by the compressed-tensors package."""
    def quantize(name: str, weight: torch.Tensor) -> Written:
        rows, cols = weight.shape
        column_group = _act_order_groups(cols, group_size, name) if act_order else torch.arange(cols) // group_size
        codes, scales, zeros = int4_groups(weight, group_size, symmetric, column_group)
        tensors = {"weight_packed": pack_to_int32((codes - 8).to(torch.int8), 4),
                   "weight_scale": scales, "weight_shape": torch.tensor([rows, cols], dtype=torch.int32)}
        if not symmetric:
            tensors["weight_zero_point"] = pack_to_int32((zeros - 8).to(torch.int8), 4, packed_dim=0)
        if act_order:
            tensors["weight_g_idx"] = column_group.to(torch.int32)
        return tensors, dequantized_int4(codes, scales, zeros, column_group)
    return quantize


def _act_order_groups(cols: int, group_size: int, name: str) -> torch.Tensor:
    """An act-order g_idx: columns quantized in a random order, group = position // g."""
    order = torch.randperm(cols, generator=torch.Generator().manual_seed(sum(name.encode())))
    column_group = torch.empty(cols, dtype=torch.int64)
    column_group[order] = torch.arange(cols) // group_size
    return column_group


def _pack_words(codes: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8)), bits: int = 4) -> torch.Tensor:
    """32 / ``bits`` codes per int32 along ``dim``; field i holds element ``order[i]``."""
    per_word = 32 // bits
    codes = codes.to(torch.int64)
    moved = codes if dim == 1 else codes.t()
    rows, cols = moved.shape
    grouped = moved.reshape(rows, cols // per_word, per_word)
    words = torch.zeros(rows, cols // per_word, dtype=torch.int64)
    for field, element in enumerate(order[:per_word]):
        words |= grouped[:, :, element] << (bits * field)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words if dim == 1 else words.t()


def gptq_8bit(group_size: int, act_order: bool = False) -> Callable[[str, torch.Tensor], Written]:
    """8-bit symmetric GPTQ (v1): four codes per int32, zero point 128 stored as 127."""
    def quantize(name: str, weight: torch.Tensor) -> Written:
        cols = weight.shape[1]
        column_group = _act_order_groups(cols, group_size, name) if act_order else torch.arange(cols) // group_size
        scales = torch.stack([weight[:, column_group == group].abs().amax(dim=1) / 127.0
                              for group in range(cols // group_size)], dim=1).half()
        codes = (weight / scales.float()[:, column_group]).round().clamp(-128, 127) + 128
        zeros = torch.full_like(scales, 128, dtype=torch.int64)
        tensors = {"qweight": _pack_words(codes.t(), dim=0, bits=8), "qzeros": _pack_words((zeros - 1).t(), 1, bits=8),
                   "scales": scales.t(), "g_idx": column_group.to(torch.int32)}
        return tensors, dequantized_int4(codes, scales, zeros, column_group)
    return quantize


def gptq(group_size: int, symmetric: bool, act_order: bool = False,
         version: str = "gptq") -> Callable[[str, torch.Tensor], Written]:
    """GPTQ's layout: qweight [K/8, N], qzeros [G, N/8] (zero - 1 in v1), scales [G, N], g_idx."""
    def quantize(name: str, weight: torch.Tensor) -> Written:
        cols = weight.shape[1]
        column_group = _act_order_groups(cols, group_size, name) if act_order else torch.arange(cols) // group_size
        codes, scales, zeros = int4_groups(weight, group_size, symmetric, column_group)
        stored_zeros = (zeros - 1) & 0xF if version == "gptq" else zeros
        tensors = {"qweight": _pack_words(codes.t(), dim=0), "qzeros": _pack_words(stored_zeros.t(), dim=1),
                   "scales": scales.t(), "g_idx": column_group.to(torch.int32)}
        return tensors, dequantized_int4(codes, scales, zeros, column_group)
    return quantize


def awq(group_size: int) -> Callable[[str, torch.Tensor], Written]:
    """AWQ gemm's layout: qweight [K, N/8] and qzeros [G, N/8] in its nibble order, scales [G, N]."""
    def quantize(name: str, weight: torch.Tensor) -> Written:
        cols = weight.shape[1]
        column_group = torch.arange(cols) // group_size
        codes, scales, zeros = int4_groups(weight, group_size, False, column_group)
        tensors = {"qweight": _pack_words(codes.t(), dim=1, order=AWQ_ORDER),
                   "qzeros": _pack_words(zeros.t(), dim=1, order=AWQ_ORDER), "scales": scales.t()}
        return tensors, dequantized_int4(codes, scales, zeros, column_group)
    return quantize


def compressed_config(fmt: str, weights: dict[str, Any], input_activations: dict[str, Any] | None = None,
                      ignore: tuple[str, ...] = ("lm_head",)) -> dict[str, Any]:
    """A compressed-tensors quantization_config with one scheme over every Linear."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": input_activations}},
            "ignore": list(ignore)}
