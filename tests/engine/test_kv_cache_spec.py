"""Per-layer cache specs read from model configs, and the cache planned from them."""

import pytest
import torch
import transformers

from shardline.engine.model.kv_cache_spec import KVCacheSpec, LayerCacheSpec, plan_num_blocks
from shardline.engine.model.loader import UnsupportedLayerError
from shardline.engine.tiny import build_tiny_model


def test_layer_kinds_follow_the_configs_layer_types(tmp_path):
    config = transformers.AutoConfig.from_pretrained(build_tiny_model(tmp_path, "gemma2"))
    spec = KVCacheSpec.from_hf_config(config, torch.float32)
    assert [layer.kind for layer in spec.layers] == [
        {"full_attention": "full", "sliding_attention": "sliding_window"}[kind] for kind in config.layer_types]
    sliding = [layer for layer in spec.layers if layer.kind == "sliding_window"]
    assert sliding and all(layer.sliding_window == config.sliding_window for layer in sliding)
    assert all(layer.sliding_window is None for layer in spec.layers if layer.kind == "full")


def test_a_block_holds_every_layers_keys_and_values():
    layers = (LayerCacheSpec("full", 2, 16, 16), LayerCacheSpec("sliding_window", 4, 8, 24, sliding_window=32))
    spec = KVCacheSpec(layers, torch.bfloat16)
    assert spec.bytes_per_block(16) == 2 * 16 * (2 * (16 + 16) + 4 * (8 + 24))
    caches = spec.allocate(num_blocks=3, block_size=16, device=torch.device("cpu"))
    assert [(k.shape, v.shape) for k, v in caches] == [((3, 16, 2, 16), (3, 16, 2, 16)),
                                                      ((3, 16, 4, 8), (3, 16, 4, 24))]
    assert plan_num_blocks(spec, 16, max_num_seqs=2, model_len=64, free_bytes=10**9) == 2 * 4 + 1
    with pytest.raises(ValueError, match="holds no block"):
        plan_num_blocks(spec, 16, max_num_seqs=2, model_len=64, free_bytes=100)


def test_a_layer_with_state_outside_the_cache_is_refused_by_name():
    config = transformers.LlamaConfig(num_hidden_layers=3)
    config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(UnsupportedLayerError, match="layer 1 is a 'linear_attention' layer"):
        KVCacheSpec.from_hf_config(config, torch.float32)
