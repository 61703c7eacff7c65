"""The load check: the engine refuses a model whose paged path it would run wrongly,
and loads those it runs exactly."""

import pytest

from shardline import LLM
from shardline.engine.errors import UnsupportedLayerError
from shardline.engine.model.load_check import ModelMismatchError
from shardline.engine.model.tiny import build_tiny_model

# gpt-oss: a learned sink logit per head joins every softmax (attention sinks).
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8)
# llama4: layer 0 attends within aligned chunks of 4 tokens (chunked local attention).
LLAMA4_TEXT = dict(attention_chunk_size=4, head_dim=16, num_local_experts=2, intermediate_size_mlp=128,
                   no_rope_layers=[1, 0])


def test_models_the_engine_runs_exactly_pass(tiny_llama_dir):
    for dtype in ("float64", "float32", "bfloat16"):
        llm = LLM(tiny_llama_dir, dtype=dtype)
        assert llm.llm_engine.config.check_model
        llm.close()


# gemma3_text with bidirectional attention (EmbeddingGemma's setting): every token
# attends to the tokens after it as well, which causal paged attention does not do.
BIDIRECTIONAL_GEMMA3 = dict(use_bidirectional_attention=True, sliding_window=8)


def test_a_model_the_paged_path_runs_wrongly_is_refused_naming_the_layer(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "gemma3_text", **BIDIRECTIONAL_GEMMA3))
    with pytest.raises(ModelMismatchError,
                       match=r"Gemma3ForCausalLM: .* layer 0 \(Gemma3DecoderLayer\) .* position 0 "):
        LLM(model_dir, dtype="float32")


def test_the_check_can_be_turned_off(tmp_path):
    model_dir = str(build_tiny_model(tmp_path, "gemma3_text", **BIDIRECTIONAL_GEMMA3))
    LLM(model_dir, dtype="float32", check_model=False).close()


@pytest.mark.parametrize("arch,overrides", [("gpt_oss", GPT_OSS), ("llama4_text", LLAMA4_TEXT)])
def test_attention_sinks_and_chunked_attention_pass(tmp_path, arch, overrides):
    """Sinks (gpt_oss) and chunked local attention (llama4_text) run exactly: the check
    passes (tests/engine/attention/test_attention_features.py compares their greedy tokens)."""
    model_dir = str(build_tiny_model(tmp_path, arch, **overrides))
    LLM(model_dir, dtype="float32").close()


@pytest.mark.parametrize("arch,layer_type,overrides", [
    ("cpmant", "its prompt attends bidirectionally", dict(dim_head=16, dim_ff=128, prompt_length=4)),
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

    from ..hf_reference import hf_greedy, load_hf_model

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
