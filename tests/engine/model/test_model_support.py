"""The one verdict on whether a model can run (engine/model/support.py), from configs
alone: no weights are written or read."""

from __future__ import annotations

import pytest
import transformers

from shardline.engine.errors import UnsupportedLayerError, UnsupportedModelError
from shardline.engine.model.support import model_support, require_supported, routes_attention_interface
from shardline.engine.model.tiny import tiny_config

from ..coverage import VOCAB_SIZE, tiny_overrides


def _tiny(model_type: str, **overrides) -> transformers.PretrainedConfig:
    return tiny_config(model_type, VOCAB_SIZE, **{**tiny_overrides(model_type), **overrides})


def test_a_supported_model_runs_for_both_tasks():
    config = _tiny("llama")
    generate = model_support(config, "generate")
    assert generate.ok and generate.reason is None
    assert (generate.architecture, generate.model_type) == ("LlamaForCausalLM", "llama")
    assert require_supported(config, "embed").architecture == "LlamaModel"


def test_a_refused_model_type_names_the_class_and_the_reason():
    support = model_support(_tiny("cpmant"), "generate")
    assert not support.ok and support.layer is None
    assert support.reason.startswith("its prompt attends bidirectionally")
    with pytest.raises(UnsupportedModelError) as raised:
        require_supported(_tiny("cpmant"))
    assert str(raised.value) == f"CpmAntForCausalLM (cpmant) cannot run on shardline: {support.reason}"
    assert not isinstance(raised.value, UnsupportedLayerError)


def test_a_sparse_attention_indexer_runs_on_the_generation_engine_only():
    assert model_support(_tiny("deepseek_v32"), "generate").ok
    support = model_support(_tiny("deepseek_v32"), "embed")
    assert not support.ok and support.layer == 0
    assert "whose indexer picks each query's keys" in support.reason
    assert model_support(_tiny("deepseek_v4"), "generate").ok  # keys compressed over blocks (adapters/deepseek_v4.py)
    support = model_support(_tiny("deepseek_v4"), "embed")
    assert not support.ok and "adapters that attend the paged KV cache" in support.reason


def test_an_unknown_layer_type_is_refused_naming_the_layer():
    config = _tiny("llama", num_hidden_layers=3)
    config.layer_types = ["full_attention", "full_attention", "lightning_attention"]
    support = model_support(config, "generate")
    assert not support.ok and support.layer == 2
    assert support.reason.startswith("layer 2 is a 'lightning_attention' layer, which keeps state that is not keys")
    with pytest.raises(UnsupportedLayerError, match=r"^LlamaForCausalLM \(llama\) cannot run on shardline: layer 2 is"):
        require_supported(config, "generate")


def test_the_pooling_engine_refuses_what_its_packed_forward_cannot_run():
    """Recurrent state (each step packs its prompts into one sequence), and attention
    that runs on shardline only through the paged KV cache's adapters; both generate."""
    hybrid = model_support(_tiny("qwen3_next"), "embed")
    assert not hybrid.ok and "keeps no per-request recurrent state" in hybrid.reason
    adapted = model_support(_tiny("falcon"), "embed")
    assert not adapted.ok and "adapters that attend the paged KV cache" in adapted.reason
    assert model_support(_tiny("qwen3_next"), "generate").ok and model_support(_tiny("falcon"), "generate").ok


def test_attention_outside_transformers_interface_does_not_route():
    assert not routes_attention_interface(transformers.CpmAntForCausalLM, transformers.CpmAntConfig())
    # A model of recurrent layers only (RWKV) has no attention to route.
    assert routes_attention_interface(transformers.RwkvForCausalLM, transformers.RwkvConfig())
    assert routes_attention_interface(transformers.LlamaForCausalLM, _tiny("llama"))
    assert routes_attention_interface(transformers.FalconForCausalLM, _tiny("falcon"))  # through its adapter


def test_a_model_type_without_a_class_for_the_task_and_an_unknown_task_are_named():
    t5 = model_support(transformers.T5Config(num_layers=2), "generate")
    assert not t5.ok
    assert t5.reason == "transformers has no causal language model class for model_type 't5' (task generate)"
    with pytest.raises(ValueError, match="task must be one of generate, embed, got 'chat'"):
        model_support(_tiny("llama"), "chat")
