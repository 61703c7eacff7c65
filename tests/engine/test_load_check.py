"""The load check: the engine refuses a model whose paged path it would run wrongly,
and loads those it runs exactly."""

import pytest

from shardline import LLM
from shardline.engine.model.loader import UnsupportedLayerError
from shardline.engine.model.load_check import ModelMismatchError
from shardline.engine.tiny import build_tiny_model

# gpt-oss: a learned sink logit per head joins every softmax (attention sinks).
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8)


def test_models_the_engine_runs_exactly_pass(tiny_llama_dir):
    for dtype in ("float64", "float32", "bfloat16"):
        llm = LLM(tiny_llama_dir, dtype=dtype)
        assert llm.llm_engine.config.check_model
        llm.close()


def test_ignored_attention_sinks_are_refused_naming_the_layer(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "gpt_oss", **GPT_OSS))
    with pytest.raises(ModelMismatchError, match=r"GptOssForCausalLM: .* layer 0 \(GptOssDecoderLayer\)"):
        LLM(model_dir, dtype="float32")


def test_the_check_can_be_turned_off(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "gpt_oss", **GPT_OSS))
    LLM(model_dir, dtype="float32", check_model=False).close()


@pytest.mark.parametrize("arch,layer_type,overrides", [
    ("llama4_text", "chunked_attention", dict(attention_chunk_size=4, head_dim=16, num_local_experts=2,
                                              intermediate_size_mlp=128, no_rope_layers=[1, 1])),
    ("olmo_hybrid", "linear_attention", dict(head_dim=16)),
])
def test_layers_the_cache_cannot_hold_are_refused_by_name(tmp_path, arch, layer_type, overrides):
    model_dir = str(build_tiny_model(tmp_path, arch, **overrides))
    with pytest.raises((UnsupportedLayerError, ValueError), match=layer_type):
        LLM(model_dir, dtype="float32")


def test_per_layer_head_sizes_run_exactly(tmp_path):
    """gemma4: sliding layers of head size 16, full ones of 32, each cached at its own
    size; the check passes and greedy tokens equal transformers' in float64."""
    from shardline import SamplingParams
    from shardline.engine.model.kv_cache_spec import KVCacheSpec

    from .hf_reference import hf_greedy, load_hf_model

    model_dir = str(build_tiny_model(tmp_path, "gemma4_text", head_dim=16, global_head_dim=32, sliding_window=8))
    llm = LLM(model_dir, dtype="float64")
    spec = llm.llm_engine.runner.spec
    assert isinstance(spec, KVCacheSpec) and {layer.head_dim for layer in spec.layers} == {16, 32}
    prompts = [[5, 6, 7], list(range(3, 40))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                 use_tqdm=False)]
    llm.close()
    reference = load_hf_model(model_dir)
    assert ours == [hf_greedy(reference, prompt, 8) for prompt in prompts]
