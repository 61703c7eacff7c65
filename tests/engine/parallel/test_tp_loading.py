"""A tensor-parallel rank reads only its slices of the split weights: each rank's shard
read slice by slice equals, tensor for tensor, the shard cut from the whole model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from shardline.engine.config import EngineConfig
from shardline.engine.errors import ModelLoadError
from shardline.engine.model.adapters import adapt_attention
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.loader import load_causal_lm
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.parallel.group import RankGroup
from shardline.engine.parallel.loading import SliceReader
from shardline.engine.parallel.placement import shard_then_place

from .test_tensor_parallel import GDN, MLA, MOE
from .test_tp_float_experts import GPT_OSS


def shard(model_dir: str, rank: int, slices: bool) -> tuple[nn.Module, SliceReader]:
    """Rank ``rank`` of 2's shard of the model, its split weights read as slices or cut
    from the whole model, through the adapters and the sharding step as the engine runs them."""
    config = EngineConfig(model=model_dir, dtype="float32", tensor_parallel_size=2)
    reader = SliceReader()
    loaded = load_causal_lm(config, reader if slices else None)
    adapt_attention(loaded.model)
    layers = sum(1 for layer in KVCacheSpec.from_hf_config(loaded.hf_config, loaded.dtype).layers if layer.num_kv_heads)
    shard_then_place(loaded.model, RankGroup(rank, 2, lambda: ""), layers, torch.device("cpu"),
                     place=lambda model, device: None, checkpoint=reader.checkpoint if slices else None)
    return loaded.model, reader


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama_one_kv_head": ("llama", {"num_key_value_heads": 1}),
    "llama_tied_and_biased_vocab": ("llama", {"tie_word_embeddings": True, "vocab_size": 511}),
    "deepseek_v3": ("deepseek_v3", MLA),  # latent attention, experts stored per expert
    "qwen2_moe": ("qwen2_moe", MOE),  # q/k/v biases, shared experts
    "qwen3_5_text": ("qwen3_5_text", GDN),  # recurrent layers read whole, split by their own rules
    "qwen3_next": ("qwen3_next", {**GDN, **MOE}),  # experts (per expert) beside recurrent and attention mixers
    "gpt_oss": ("gpt_oss", GPT_OSS),  # float experts: biased, transposed, interleaved, uneven shares
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_slices_equal_the_whole_models_split(case, tmp_path):
    arch, overrides = CASES[case]
    model_dir = str(build_tiny_model(tmp_path, arch, **overrides))
    for rank in (0, 1):
        expected, _ = shard(model_dir, rank, slices=False)
        got, reader = shard(model_dir, rank, slices=True)
        assert reader.checkpoint is not None, "read whole: the slice reader declined the model"
        assert {p.device.type for p in got.parameters()} == {"cpu"}
        want, have = expected.state_dict(), got.state_dict()
        assert sorted(want) == sorted(have)
        for name, tensor in want.items():
            assert have[name].dtype == tensor.dtype and torch.equal(have[name], tensor), (case, rank, name)


def test_a_checkpoint_it_cannot_read_exactly_is_read_whole(tmp_path):
    """A weight stored in another shape: the reader declines, and the whole read refuses it."""
    model_dir = build_tiny_model(tmp_path, "llama")

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.input_layernorm.weight"
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    reader = SliceReader()
    with pytest.raises(ModelLoadError, match="cannot load model weights"):
        load_causal_lm(EngineConfig(model=str(model_dir), dtype="float32", tensor_parallel_size=2), reader)
    assert reader.checkpoint is None
