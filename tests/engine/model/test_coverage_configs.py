"""The three ways a model type crashed instead of running or being refused, each at its
cause: dbrx's key-value heads given in its nested attention config (and gpt_bigcode's
by multi_query) beside a stale top-level count, gemma3n's KV
sharing over a small layer count, git's attention picked from a table by name."""

from __future__ import annotations

import pytest
import transformers

from shardline.engine.model.loader import key_value_heads
from shardline.engine.model.support import model_support
from shardline.engine.model.tiny import tiny_config

from ..coverage import VOCAB_SIZE, check_type, quiet_transformers, second_config, tiny_overrides


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    quiet_transformers()


def test_dbrx_key_value_heads_come_from_its_nested_attention_config():
    """Its attention reads attn_config.kv_n_heads; a stale top-level mirror is not read."""
    config = tiny_config("dbrx", VOCAB_SIZE, **second_config("dbrx"))
    assert config.num_key_value_heads == 1 and config.attn_config.kv_n_heads == 4
    assert key_value_heads(config, config.num_attention_heads) == 4
    as_dict = transformers.LlamaConfig(num_key_value_heads=2)
    as_dict.attn_config = {"kv_n_heads": 3}
    assert key_value_heads(as_dict, 4) == 3


def test_multi_query_decides_over_a_stale_num_key_value_heads():
    """gpt_bigcode's attention reads multi_query; its num_key_value_heads only mirrors it."""
    config = tiny_config("gpt_bigcode", VOCAB_SIZE, **second_config("gpt_bigcode"))
    assert config.multi_query and config.num_key_value_heads == 2
    assert key_value_heads(config, config.num_attention_heads) == 1
    config.multi_query = False
    assert key_value_heads(config, config.num_attention_heads) == config.num_attention_heads


@pytest.mark.parametrize("model_type", ["dbrx", "gpt_bigcode"])
def test_a_stale_top_level_kv_head_count_runs_token_exact(model_type, tmp_path):
    result = check_type(model_type, tmp_path, config=2)
    assert result.outcome == "parity", result.line()



def test_gemma3n_sharing_kv_over_four_layers_runs_token_exact(tmp_path):
    overrides = tiny_overrides("gemma3n_text", 2)
    assert overrides["num_hidden_layers"] == 4 and overrides["num_kv_shared_layers"] == 2
    config = tiny_config("gemma3n_text", VOCAB_SIZE, **overrides)
    assert config.kv_sharing_modes.count("reuse") == 2  # the last two layers attend the others' keys
    result = check_type("gemma3n_text", tmp_path, config=2)
    assert result.outcome == "parity", result.line()


def test_git_is_refused_with_one_line_naming_its_attention():
    config = tiny_config("git", VOCAB_SIZE, **tiny_overrides("git"))
    support = model_support(config)
    assert not support.ok
    assert "chosen from a table by implementation name" in support.message
    assert "\n" not in support.message
