"""Model loading: safetensors by default, dtypes, local directories."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.model.loader import ModelLoadError
from shardline.engine.tiny import build_tiny_model


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
