"""CheckpointTensors: a sharded checkpoint's tensors by name, read lazily."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from shardline.engine.quantization.checkpoint import CheckpointTensors, QuantizedCheckpointError


def test_sharded_checkpoint_by_name(tmp_path):
    first = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    second = {"b.qweight": torch.ones(4, 2, dtype=torch.int32), "b.scale": torch.tensor([0.5], dtype=torch.bfloat16)}
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {**{name: "model-00001-of-00002.safetensors" for name in first},
                  **{name: "model-00002-of-00002.safetensors" for name in second}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tensors = CheckpointTensors(tmp_path)
    assert tensors.names() == {"a.weight", "b.qweight", "b.scale"}
    assert tensors.dtype("b.scale") == torch.bfloat16 and tensors.shape("b.qweight") == (4, 2)
    assert torch.equal(tensors.get("a.weight"), first["a.weight"])
    with pytest.raises(QuantizedCheckpointError) as error:
        tensors.get("b.qzeros", "the zero points")
    assert str(error.value) == f"checkpoint {tmp_path} has no tensor 'b.qzeros' (the zero points)"


def test_directory_without_safetensors(tmp_path):
    with pytest.raises(QuantizedCheckpointError, match="has no safetensors files"):
        CheckpointTensors(tmp_path)
