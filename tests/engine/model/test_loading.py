"""Model loading: safetensors by default, dtypes, local directories."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.errors import ModelLoadError
from shardline.engine.model.tiny import build_tiny_model

from ..hf_reference import engine_greedy, hf_greedy, random_prompts


@pytest.fixture(scope="module")
def bin_only_model(tmp_path_factory):
    """A checkpoint saved as pytorch_model.bin only (no safetensors)."""
    source = build_tiny_model(tmp_path_factory.mktemp("src"), "llama")
    target = tmp_path_factory.mktemp("bin-only")
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    model.config.save_pretrained(target)
    torch.save(model.state_dict(), target / "pytorch_model.bin")
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(target)
    assert not list(target.glob("*.safetensors"))
    return str(target)


def test_safetensors_only_unless_opted_out(bin_only_model):
    with pytest.raises(ModelLoadError, match="bin-only"):
        LLM(bin_only_model)
    llm = LLM(bin_only_model, use_safetensors=False)
    [output] = llm.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 2


@pytest.mark.parametrize("dtype,expected", [
    ("auto", torch.float32), ("float32", torch.float32), ("bfloat16", torch.bfloat16),
    ("float16", torch.float16), ("float64", torch.float64),
])
def test_dtypes(tiny_llama_dir, dtype, expected):
    llm = LLM(tiny_llama_dir, dtype=dtype)
    engine = llm.llm_engine
    assert next(engine.model.parameters()).dtype == expected
    assert engine.runner.kv_caches[0][0].dtype == expected
    [output] = llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


def test_unknown_dtype_is_named(tiny_llama_dir):
    with pytest.raises(ValueError, match="float8"):
        LLM(tiny_llama_dir, dtype="float8")


def test_trust_remote_code_is_off_by_default(tiny_llama_dir):
    assert LLM(tiny_llama_dir).engine_config.trust_remote_code is False


@pytest.mark.parametrize("arch,reason", [
    ("cpmant", "its prompt attends bidirectionally"),
])
def test_model_types_the_cache_cannot_hold_are_refused_with_the_reason(tmp_path, arch, reason):
    from shardline.engine.errors import UnsupportedModelError
    from shardline.engine.model.tiny import build_tiny_model

    from ..coverage import tiny_overrides

    model_dir = str(build_tiny_model(tmp_path, arch, **tiny_overrides(arch)))
    with pytest.raises(UnsupportedModelError, match=reason):
        LLM(model_dir, dtype="float64")


def test_multi_query_and_repeated_key_value_heads_are_cached_as_the_model_passes_them(tmp_path):
    """gpt_bigcode's multi-query attention passes one key head, jetmoe its key heads
    repeated for each of its top-k attention experts: the cache holds what is passed."""
    from shardline.engine.model.tiny import build_tiny_model

    for arch, heads in (("gpt_bigcode", 1), ("jetmoe", 4)):
        model_dir = str(build_tiny_model(tmp_path / arch, arch, num_experts_per_tok=2, num_local_experts=4))
        llm = LLM(model_dir, dtype="float64")  # the load check passes
        assert {layer.num_kv_heads for layer in llm.llm_engine.runner.spec.layers} == {heads}
        llm.close()


@pytest.mark.parametrize("change", ["drop", "reshape"])
def test_a_checkpoint_lacking_a_weight_is_refused_not_initialised_at_random(tmp_path, change):
    """transformers fills a missing (or wrongly shaped) weight at random with a warning;
    the engine refuses the checkpoint, naming the tensor."""
    from safetensors.torch import load_file, save_file

    model_dir = build_tiny_model(tmp_path / "llama", "llama")
    weights_path = next(model_dir.glob("*.safetensors"))
    weights = load_file(str(weights_path))
    name = "model.layers.0.mlp.down_proj.weight"
    if change == "drop":
        del weights[name]
    else:
        weights[name] = weights[name][:, :-1].contiguous()
    save_file(weights, str(weights_path), metadata={"format": "pt"})
    message = r"down_proj\.weight.*initialise them at random" if change == "drop" else "cannot load model weights"
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(model_dir), dtype="float32")


def test_a_float64_moe_model_runs_its_experts_eagerly(tmp_path):
    """transformers' default grouped experts take no float64; the engine loads a float64
    MoE model with eager experts, which give its float64 reference's tokens."""
    model_dir = str(build_tiny_model(tmp_path, "qwen3_moe"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager").eval()
    prompts = random_prompts(3, (4, 12), 512, seed=3)
    expected = [hf_greedy(reference, prompt, 6) for prompt in prompts]
    assert engine_greedy(LLM(model_dir, dtype="float64"), prompts, 6) == expected
