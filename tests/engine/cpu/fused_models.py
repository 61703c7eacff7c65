"""A tiny Llama whose decoder layers are wrapped as the CPU path wraps them, outside any
engine step (for the tests of what a plain transformers call then runs)."""

from __future__ import annotations

import torch
import transformers

from shardline.engine.attention.context import paged_attention_forward
from shardline.engine.cpu.layers import FusedDecoderLayer
from shardline.engine.model.tiny import build_tiny_model

IDS = torch.tensor([[5, 6, 7, 8]])


def llama_with_fused_layers(tmp_path) -> tuple[transformers.PreTrainedModel, torch.Tensor]:
    """The model with every layer a FusedDecoderLayer, and its own logits on IDS from
    before the wrapping."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(build_tiny_model(tmp_path, "llama"))).eval()
    with torch.no_grad():
        expected = model(IDS).logits
    layers = model.model.layers
    for position, layer in enumerate(layers):
        layers[position] = FusedDecoderLayer(layer, paged_attention_forward, is_last=False, rows_hint=16)
    return model, expected
