"""Bad input raises a clear error naming the bad value."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.config import ConfigError
from shardline.engine.errors import ModelLoadError, UnsupportedModelError
from shardline.engine.model.tiny import build_tokenizer


def test_empty_prompt(tiny_llm):
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate("", use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_token_ids_outside_vocabulary(tiny_llm):
    with pytest.raises(ValueError, match=r"99999.*\[0, 512\)"):
        tiny_llm.generate({"prompt_token_ids": [5, 99999]}, use_tqdm=False)
    with pytest.raises(ValueError, match="-1"):
        tiny_llm.generate({"prompt_token_ids": [-1]}, use_tqdm=False)


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_below_one(max_tokens):
    with pytest.raises(ValueError, match=rf"max_tokens.*{max_tokens}"):
        SamplingParams(max_tokens=max_tokens)


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("n", 0)])
def test_invalid_sampling_values(field, value):
    with pytest.raises(ValueError, match=rf"{field}.*{value}"):
        SamplingParams(**{field: value})


def test_unknown_model_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match="no-such-model"):
        LLM(missing)


@pytest.mark.parametrize("option", ["max_num_batched_tokens", "max_num_seqs", "block_size"])
def test_non_positive_budget(tiny_llama_dir, option):
    with pytest.raises(ConfigError, match=rf"{option}.*0"):
        LLM(tiny_llama_dir, **{option: 0})


def test_unknown_option_is_named(tiny_llama_dir):
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(tiny_llama_dir, max_num_sequences=4)


def test_max_model_len_above_the_model(tiny_llama_dir):
    with pytest.raises(ValueError, match="4096.*1024"):
        LLM(tiny_llama_dir, max_model_len=4096)


def test_prompt_longer_than_max_model_len_names_request_length_and_limit(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float64", max_model_len=64)
    with pytest.raises(ValueError) as info:
        llm.llm_engine.add_request("req-7", {"prompt_token_ids": [5] * 70}, SamplingParams())
    message = str(info.value)
    assert "req-7" in message and "70" in message and "64" in message


def test_architecture_without_attention_interface(tmp_path):
    build_tokenizer(tmp_path)
    config = transformers.CpmAntConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       dim_head=16, dim_ff=64, prompt_length=4)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="CpmAnt"):
        LLM(str(tmp_path))


def test_token_budget_defaults_per_device_and_an_explicit_one_stays(tiny_llama_dir):
    from shardline.engine.config import DEFAULT_TOKEN_BUDGETS, EngineConfig

    config = EngineConfig("m")
    assert config.max_num_batched_tokens is None
    assert config.with_token_budget("cuda").max_num_batched_tokens == DEFAULT_TOKEN_BUDGETS["cuda"]
    assert config.max_num_batched_tokens is None  # frozen: the filled-in budget is a new config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_batched_tokens = 8  # type: ignore[misc]  # the assignment under test
    llm = LLM(tiny_llama_dir, device="cpu")
    assert llm.llm_engine.config.max_num_batched_tokens == DEFAULT_TOKEN_BUDGETS["cpu"]
    assert llm.llm_engine.scheduler.config.max_num_batched_tokens == DEFAULT_TOKEN_BUDGETS["cpu"]
    llm.close()
    llm = LLM(tiny_llama_dir, device="cpu", max_num_batched_tokens=96)
    assert llm.llm_engine.scheduler.config.max_num_batched_tokens == 96
    llm.close()
