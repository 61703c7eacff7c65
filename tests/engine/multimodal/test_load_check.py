"""The load check runs an image probe through the paged path on a vision-language model:
an encoder whose rows differ from the model's own is refused at load."""

from __future__ import annotations

import pytest

from shardline import LLM
from shardline.engine.model.load_check import ModelMismatchError
from shardline.engine.multimodal import specs


def test_an_image_path_other_than_the_models_is_refused_at_load(tiny_llava_dir, monkeypatch):
    def second_to_last_layer(model, pixel_inputs, rows_per_image):  # features the model does not use
        return specs.image_features(model, {**pixel_inputs, "vision_feature_layer": -2}, rows_per_image)

    monkeypatch.setitem(specs.VISION_SPECS, "llava", specs.VisionSpec("llava", encode=second_to_last_layer))
    with pytest.raises(ModelMismatchError, match=r"layer 0 .* first at position 3 of a \d+-token probe"):
        LLM(tiny_llava_dir, dtype="float32")


def test_the_check_leaves_no_encoder_runs_behind(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, dtype="float32")
    cache = llm.llm_engine.runner.encoder_cache
    assert cache is not None and cache.num_encoded_images == 0 and not cache.outputs
