"""The tensor-parallel verdict answers every refusal the load would raise: a split the
sharding step cannot make is refused by the pipeline's pre-flight with the engine's own
line, and by the engine before any rank starts."""

from __future__ import annotations

import multiprocessing

import pytest

from shardline import LLM
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.parallel.group import ShardingError
from shardline.tasks.errors import ModelUnusable
from shardline.tasks.preflight import check_model


@pytest.mark.parametrize(("arch", "overrides", "reason"), [
    ("llama", {"intermediate_size": 63}, "gate_proj: 63 output features do not split over 2 ranks"),
    # falcon's fused query-key-value projection beside the ALiBi table its adapter builds, found by the split
    ("falcon", {"alibi": True}, "query_key_value: FalconAttention with ALiBi"),
])
def test_preflight_refuses_what_the_split_would(arch, overrides, reason, tmp_path, make_job):
    model_dir = str(build_tiny_model(tmp_path / "model", arch, **overrides))
    with pytest.raises(ModelUnusable) as refused:
        check_model(make_job(model=model_dir, tensor_parallel_size=2))
    assert reason in refused.value.reason
    with pytest.raises(ShardingError) as engine:
        LLM(model_dir, dtype="float32", tensor_parallel_size=2)
    assert str(engine.value) == refused.value.reason
    assert not multiprocessing.active_children()  # refused before any rank started
    check_model(make_job(model=model_dir))  # one rank runs it
