"""Pre-flight refuses every model type the engine refuses, with the engine's reason.

Each type is the coverage sweep's tiny build (tests/engine/coverage.py), written as
config and tokenizer only: the verdict (engine/model/support.py) reads no weights, so
pre-flight fails, and the loader refuses with the same line, before any weight is read.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from shardline.engine.config import EngineConfig
from shardline.engine.errors import UnsupportedModelError
from shardline.engine.model.loader import load_causal_lm
from shardline.engine.model.support import model_support
from shardline.engine.model.tiny import tiny_config
from shardline.tasks.errors import ModelUnusable
from shardline.tasks.preflight import PreflightFailed, check_model, preflight
from shardline.tasks.sample_data import write_sample_dataset

from ..engine.coverage import SKIPPED, VOCAB_SIZE, decoder_model_types, tiny_overrides, write_tiny_config

# The types the model-coverage sweep reports refused (`python -m tests.engine.coverage`).
# kolibri1_1 (its indexer's selection) is new in transformers 5.25.
REFUSED_TYPES = ("blt", "cpmant", "git") + (("kolibri1_1",) if "kolibri1_1" in CONFIG_MAPPING_NAMES else ())


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny type's config and tokenizer; the others copy its tokenizer files."""
    return write_tiny_config("llama", tmp_path_factory.mktemp("tokenizer"))


def _config_only(model_type: str, tokenizer_dir: Path, root: Path) -> Path:
    """``model_type``'s tiny config beside the shared tokenizer: no weights."""
    model_dir = root / model_type
    shutil.copytree(tokenizer_dir, model_dir)
    (model_dir / "config.json").unlink()
    tiny_config(model_type, VOCAB_SIZE, **tiny_overrides(model_type)).save_pretrained(str(model_dir))
    return model_dir


@pytest.mark.parametrize("model_type", REFUSED_TYPES)
def test_preflight_refuses_with_the_loaders_reason(model_type, tokenizer_dir, tmp_path, make_job):
    model_dir = _config_only(model_type, tokenizer_dir, tmp_path)
    with pytest.raises(ModelUnusable) as refused:
        check_model(make_job(model=str(model_dir)))
    with pytest.raises(UnsupportedModelError) as loader:
        load_causal_lm(EngineConfig(model=str(model_dir), dtype="float32"))
    assert refused.value.reason == str(loader.value)
    assert str(refused.value) == f"load model {model_dir} failed: {loader.value}"
    assert "cannot run on shardline: " in str(loader.value)


def test_a_refused_model_fails_before_any_shard_is_read_or_output_written(tokenizer_dir, tmp_path, make_job):
    model_dir = _config_only("blt", tokenizer_dir, tmp_path / "models")
    write_sample_dataset(str(tmp_path / "in"), num_shards=2, rows_per_shard=2)
    with pytest.raises(PreflightFailed) as failed:
        preflight(make_job(model=str(model_dir)))
    [error] = failed.value.errors
    assert isinstance(error, ModelUnusable) and "a byte-level patch model" in error.reason
    written = [path for path in (tmp_path / "out").rglob("*") if path.is_file()]
    assert written == []


@pytest.mark.slow
def test_the_verdict_refuses_exactly_the_refused_types():
    """Over every decoder type the sweep builds, the verdict (the pre-flight's and the
    loader's) refuses these and no other."""
    refused = []
    for model_type in decoder_model_types():
        if model_type in SKIPPED:
            continue
        config = tiny_config(model_type, VOCAB_SIZE, **tiny_overrides(model_type))
        if not model_support(config, "generate").ok:
            refused.append(model_type)
    assert tuple(refused) == REFUSED_TYPES
