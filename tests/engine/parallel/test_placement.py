"""A tensor-parallel rank splits its model before the move to its device: only its
shard reaches the device-placement step (engine/parallel/placement.py)."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

from shardline.engine.attention.context import register as register_attention
from shardline.engine.model.adapters import adapt_attention
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.parallel.group import RankGroup
from shardline.engine.parallel.placement import place_on_device, shard_then_place

from .test_tensor_parallel import MLA


def q_rows_of(model: nn.Module) -> int:
    q_proj = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q_proj, nn.Linear)
    return q_proj.out_features


def parameter_count(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def test_the_shard_reaches_the_device_step_split(tmp_path):
    model_dir = build_tiny_model(tmp_path, "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    whole = parameter_count(model)
    q_rows = q_rows_of(model)
    seen: dict[str, object] = {}

    def record_then_place(placed: nn.Module, device: torch.device) -> None:
        seen["count"] = parameter_count(placed)
        seen["q_rows"] = q_rows_of(placed)
        seen["devices"] = {parameter.device.type for parameter in placed.parameters()}
        place_on_device(placed, device)

    # The meta device stands for an accelerator: the move is real, and visible.
    replaced = shard_then_place(model, RankGroup(1, 2, lambda: ""), model.config.num_hidden_layers,
                                torch.device("meta"), place=record_then_place)
    assert replaced > 0
    assert seen["devices"] == {"cpu"}  # split on the CPU, before the move
    assert seen["q_rows"] == q_rows // 2
    assert isinstance(seen["count"], int) and seen["count"] < whole
    assert {parameter.device.type for parameter in model.parameters()} == {"meta"}
    assert {buffer.device.type for buffer in model.buffers()} == {"meta"}


def test_the_move_takes_adapters_originals_with_their_own_buffers(tmp_path):
    """deepseek_v3's latent-attention adapters keep their originals unregistered; those
    originals' own buffers reach the device with the shard."""
    overrides: dict[str, Any] = dict(MLA)
    model_dir = build_tiny_model(tmp_path, "deepseek_v3", **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation=register_attention()).eval()
    assert adapt_attention(model) > 0
    originals = [original for module in model.modules()
                 if isinstance(getattr(type(module), "original", None), property)
                 and isinstance(original := module.original, nn.Module)]
    assert originals
    shard_then_place(model, RankGroup(0, 2, lambda: ""), model.config.num_hidden_layers, torch.device("meta"))
    for original in originals:
        devices = {tensor.device.type for tensor in [*original.parameters(), *original.buffers()]}
        assert devices == {"meta"}, type(original).__name__
