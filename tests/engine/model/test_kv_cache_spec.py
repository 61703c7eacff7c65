"""Per-layer cache specs read from model configs, and the cache planned from them."""

import pytest
import torch
import transformers

from shardline.engine.errors import UnsupportedLayerError
from shardline.engine.model.kv_cache_spec import KVCacheSpec, LayerCacheSpec, plan_num_blocks
from shardline.engine.model.tiny import build_tiny_model


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


def test_chunked_layers_carry_the_configs_chunk_size():
    config = transformers.AutoConfig.for_model("llama4_text", num_hidden_layers=4, attention_chunk_size=8,
                                               no_rope_layers=[1, 1, 1, 0])
    spec = KVCacheSpec.from_hf_config(config, torch.float32)
    assert [layer.kind for layer in spec.layers] == ["chunked", "chunked", "chunked", "full"]
    assert spec.chunk_sizes == (8, 8, 8, None)
    llama = KVCacheSpec.from_hf_config(transformers.LlamaConfig(num_hidden_layers=2), torch.float32)
    assert llama.chunk_sizes == ()  # no chunked layer: the backends do nothing per layer


@pytest.mark.parametrize("model_type,overrides,sizes", [
    ("deepseek_v2", dict(qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24), (48, 24)),
    ("minicpm3", dict(qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64), (96, 64)),
    ("mimo_v2_flash", dict(head_dim=192, v_head_dim=128), (192, 128)),
    ("llama", dict(hidden_size=256, num_attention_heads=8), (32, 32)),
])
def test_keys_and_values_are_cached_at_their_own_head_sizes(model_type, overrides, sizes):
    """Multi-head latent attention: keys of qk_nope + qk_rope, values of v_head_dim (on
    a host where it caches full keys and values: a quantized kv_b_proj keeps them)."""
    if "qk_nope_head_dim" in overrides:
        overrides = dict(overrides, quantization_config={"quant_method": "gptq", "bits": 4})
    config = transformers.AutoConfig.for_model(model_type, num_hidden_layers=2, **overrides)
    spec = KVCacheSpec.from_hf_config(config, torch.float32)
    attention = [layer for layer in spec.layers if layer.kind != "recurrent"]
    assert {(layer.head_dim, layer.value_head_dim) for layer in attention} == {sizes}


def test_mimo_v2_flash_sliding_layers_cache_twice_the_key_value_heads():
    config = transformers.AutoConfig.for_model("mimo_v2_flash", num_hidden_layers=3, num_key_value_heads=2,
                                               layer_types=["full_attention", "sliding_attention", "full_attention"])
    spec = KVCacheSpec.from_hf_config(config, torch.float32)
    assert [layer.num_kv_heads for layer in spec.layers] == [2, 4, 2]
