"""Broken quantized checkpoints fail at load with one line naming the tensor and the problem."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shardline import LLM
from shardline.engine.errors import ModelLoadError, UnsupportedModelError
from shardline.engine.model.tiny import build_tiny_model

from . import checkpoints as ckpt

MODULE = "model.layers.1.self_attn.q_proj"
FP8_BLOCKS = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
INT8_ASYMMETRIC = ckpt.compressed_config("int-quantized", {"num_bits": 8, "type": "int", "symmetric": False,
                                                            "strategy": "channel"})
W8A16 = ckpt.pack_quantized_int8_config(32, symmetric=False)
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("float"), "llama")


def _broken(quantize: Callable, change: Callable[[dict[str, torch.Tensor]], None]) -> Callable:
    """``quantize`` with ``change`` applied to MODULE's tensors."""
    def broken(name: str, weight: torch.Tensor):
        tensors, dequantized = quantize(name, weight)
        if name == MODULE:
            change(tensors)
        return tensors, dequantized
    return broken


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]
    return drop


def _set(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.__setitem__(name, value(tensors[name]))


BROKEN = {
    "missing_scale": (FP8_BLOCKS, _broken(ckpt.fp8_blocks((32, 32)), _drop("weight_scale_inv")),
                      [f"{MODULE}.weight", "no scale tensor", f"{MODULE}.weight_scale_inv"]),
    "block_size_mismatch": (FP8_BLOCKS, ckpt.fp8_blocks((16, 16)),
                            ["weight_scale_inv", "block size [32, 32] does not match the weight"]),
    "scale_wrong_dtype": (FP8_BLOCKS, _broken(ckpt.fp8_blocks((32, 32)),
                                              _set("weight_scale_inv", lambda scale: scale.to(torch.int32))),
                          [f"{MODULE}.weight_scale_inv", "scale stored as torch.int32"]),
    "weight_wrong_dtype": ({"quant_method": "fp8"}, _broken(ckpt.fp8_per_tensor(),
                                                            _set("weight", lambda weight: weight.to(torch.int8))),
                           [f"{MODULE}.weight", "stored as torch.int8", "float8_e4m3fn"]),
    "int8_group_size_not_dividing": (ckpt.int8_groups_config(48), ckpt.int8_groups(16),
                                     ["weight_scale", "group_size 48 does not divide the weight's 64 input columns"]),
    "int8_group_scale_wrong_shape": (ckpt.int8_groups_config(32),
                                     _broken(ckpt.int8_groups(32), _set("weight_scale", lambda scale: scale[:, :1])),
                                     [f"{MODULE}.weight_scale", "shape [64, 1]", "need [64, 2]"]),
    "qweight_wrong_shape": (GPTQ, _broken(ckpt.gptq(32, True), _set("qweight", lambda qweight: qweight[:-1])),
                            [f"{MODULE}.qweight", "shape [7, 64]", "[8, 64]"]),
    "missing_qzeros": (GPTQ, _broken(ckpt.gptq(32, True), _drop("qzeros")), [f"{MODULE}.qzeros", "has no tensor"]),
    "group_scales_wrong_shape": (
        ckpt.compressed_config("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": 32}),
        _broken(ckpt.pack_quantized(32, True), _set("weight_scale", lambda scale: scale[:, :1])),
        [f"{MODULE}.weight_scale", "shape [64, 1]", "[64, 2]"]),
    # 8-bit pack-quantized (W8A16), asymmetric by groups of 32
    "missing_weight_packed": (W8A16, _broken(ckpt.pack_quantized_int8(32, False), _drop("weight_packed")),
                              [f"{MODULE}.weight_packed", "has no tensor"]),
    "weight_shape_wrong": (W8A16, _broken(ckpt.pack_quantized_int8(32, False),
                                          _set("weight_shape", lambda shape: shape // torch.tensor([1, 2]))),
                           [f"{MODULE}.weight_shape", "holds [64, 32] where the model's linear is [64, 64]"]),
    "weight_packed_not_int32": (W8A16, _broken(ckpt.pack_quantized_int8(32, False),
                                               _set("weight_packed", lambda packed: packed.to(torch.int64))),
                                [f"{MODULE}.weight_packed", "stored as torch.int64", "int32 words of 4 8-bit codes"]),
    "packed_zero_point_unpacked": (W8A16, _broken(ckpt.pack_quantized_int8(32, False),
                                                  _set("weight_zero_point", lambda zero: zero.repeat(4, 1))),
                                   [f"{MODULE}.weight_zero_point", "shape [64, 2]", "needs [16, 2]"]),
    "missing_zero_point": (INT8_ASYMMETRIC, _broken(ckpt.int8_asymmetric(True), _drop("weight_zero_point")),
                           [f"{MODULE}.weight_zero_point", "has no tensor"]),
    "zero_point_wrong_dtype": (INT8_ASYMMETRIC,
                               _broken(ckpt.int8_asymmetric(True),
                                       _set("weight_zero_point", lambda zero: zero.to(torch.int32))),
                               [f"{MODULE}.weight_zero_point", "stored as torch.int32", "int8"]),
    "zero_point_wrong_shape": (INT8_ASYMMETRIC,
                               _broken(ckpt.int8_asymmetric(True), _set("weight_zero_point", lambda zero: zero[:1])),
                               [f"{MODULE}.weight_zero_point", "shape [1, 1]", "64 values"]),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_checkpoint_names_tensor_and_problem(name, float_dir, tmp_path):
    config, quantize, named = BROKEN[name]
    ckpt.write_quantized(float_dir, tmp_path / name, config, quantize)
    with pytest.raises(ModelLoadError) as error:
        LLM(str(tmp_path / name), dtype="float32", device="cpu")
    message = str(error.value)
    assert "\n" not in message
    for part in named:
        assert part in message, (part, message)


def test_unknown_quant_method_is_refused_at_load(float_dir, tmp_path):
    ckpt.write_quantized(float_dir, tmp_path / "unknown", {"quant_method": "squeezellm"}, ckpt.int8_per_channel)
    with pytest.raises(UnsupportedModelError, match="quant_method 'squeezellm' is not a quantization shardline reads"):
        LLM(str(tmp_path / "unknown"), dtype="float32", device="cpu")


def test_module_listed_unquantized_but_stored_quantized(float_dir, tmp_path):
    config = {**FP8_BLOCKS, "modules_to_not_convert": ["lm_head", MODULE]}
    ckpt.write_quantized(float_dir, tmp_path / "ignored", config, ckpt.fp8_blocks((32, 32)))
    with pytest.raises(ModelLoadError, match=f"{MODULE}: stored quantized, but the quantization_config lists it"):
        LLM(str(tmp_path / "ignored"), dtype="float32", device="cpu")
