"""Pre-flight checks: the model (config, tokenizer, architecture), the output (a probe
object), the input, and one line per invalid job field."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from pydantic import ValidationError

from shardline.tasks.errors import ModelUnusable, StorageError
from shardline.tasks.job import BatchJob
from shardline.tasks.preflight import PreflightFailed, check_model, field_errors, preflight
from shardline.tasks.sample_data import write_sample_dataset


def test_a_usable_model_passes_and_every_problem_is_named_at_once(tmp_path, make_job, tiny_model):
    write_sample_dataset(str(tmp_path / "in"), num_shards=2, rows_per_shard=2)
    assert check_model(make_job()) == "LlamaForCausalLM"
    assert [s.key for s in preflight(make_job())] == ["part-00000", "part-00001"]
    assert not any((tmp_path / "out" / "_tmp").iterdir())  # the probe is gone

    (tmp_path / "out-file").write_text("a file where the output prefix should be")
    job = make_job(input=str(tmp_path / "empty"), output=str(tmp_path / "out-file" / "x"),
                   model=str(tmp_path / "no-model"))
    started = time.monotonic()
    with pytest.raises(PreflightFailed) as raised:
        preflight(job)
    assert time.monotonic() - started < 5
    lines = str(raised.value).splitlines()
    assert len(lines) == 3, lines
    assert lines[0] == (f"load model {tmp_path / 'no-model'} failed: "
                        "no such local directory (and a path is not a hub id)")
    assert lines[1].startswith(f"write {tmp_path / 'out-file' / 'x'}/_tmp/.shardline-probe-") or \
        lines[1].startswith(f"write file://{tmp_path / 'out-file' / 'x'}/_tmp/.shardline-probe-")
    assert lines[2].startswith(f"list {tmp_path / 'empty'} failed: no shards under it")
    assert [type(e) for e in raised.value.errors][0] is ModelUnusable
    assert isinstance(raised.value.errors[1], StorageError)


def test_a_tool_call_parser_the_tokenizer_cannot_serve_is_refused(make_job, tiny_model):
    with pytest.raises(ModelUnusable, match=r"^load tokenizer .* needs the token \[TOOL_CALLS\]"):
        check_model(make_job(tool_call_parser="mistral"))
    check_model(make_job(tool_call_parser="hermes"))  # read on the text when the markers are not tokens


def test_an_architecture_the_paged_attention_cannot_run_is_refused(tmp_path, make_job, tiny_model):
    model = tmp_path / "cpmant-like"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "cpmant",
                                                   "architectures": ["CpmAntForCausalLM"]}))
    with pytest.raises(ModelUnusable, match=f"^load model {model} failed: CpmAntForCausalLM \\(cpmant\\) cannot run "
                                            "on shardline: its prompt attends bidirectionally"):
        check_model(make_job(model=str(model)))
    (model / "config.json").unlink()
    with pytest.raises(ModelUnusable, match=f"^load model {model} failed: "):
        check_model(make_job(model=str(model)))


def test_field_errors_are_one_line_per_field(tmp_path, tiny_model):
    with pytest.raises(ValidationError) as raised:
        BatchJob(input="in", output="out", model=tiny_model, sampling={"max_tokens": -5, "top_p": 0},
                 engine_options={"max_seqs": 2})
    lines = field_errors(raised.value)
    assert "sampling.max_tokens must be >= 1, got -5" in lines
    assert "sampling.top_p must be > 0.0, got 0" in lines
    assert any(line.startswith("engine_options: unknown engine option(s) 'max_seqs'") for line in lines)
    assert all("\n" not in line and "pydantic" not in line for line in lines)
