"""tensor_parallel_size through the pipeline's front doors: the job's field (and the
command line's flag) reach the engine's options, and the pre-flight check refuses a split
the engine would refuse, before any shard is read."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shardline.cli import build_parser, job_from_args
from shardline.tasks.errors import ModelUnusable
from shardline.tasks.preflight import check_model


def test_the_field_reaches_the_engine_options(make_job):
    assert make_job(tensor_parallel_size=2).engine_kwargs()["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in make_job().engine_kwargs()
    with pytest.raises(ValidationError, match="set tensor_parallel_size once"):
        make_job(tensor_parallel_size=2, engine_options={"tensor_parallel_size": 2})


def test_the_command_line_flag(tmp_path, tiny_model):
    args = build_parser().parse_args(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--model", tiny_model,
                                      "--tensor-parallel-size", "2"])
    assert job_from_args(args).tensor_parallel_size == 2


def test_preflight_refuses_heads_that_do_not_split(make_job):
    check_model(make_job(tensor_parallel_size=2))
    with pytest.raises(ModelUnusable, match="tensor_parallel_size=3: llama has 4 attention heads"):
        check_model(make_job(tensor_parallel_size=3))
