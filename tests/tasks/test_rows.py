"""Row validation: every bad row gets an error naming what is wrong; shards missing
their task's column fail as a whole."""

from __future__ import annotations

import json

import pytest

from shardline.engine.params import PoolingParams
from shardline.tasks.rows import prepare_shard
from shardline.tasks.shard_reader import ShardError, read_shard_records
from shardline.tasks.storage import list_shards


def _prepare(tmp_path, rows, job, name="s.jsonl"):
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return prepare_shard(read_shard_records(list_shards(str(tmp_path / name))[0]), job)


def test_bad_rows_get_errors_naming_the_problem(tmp_path, make_job):
    job = make_job(lora_adapters={"known": "/nowhere"})
    rows = [
        {"prompt": "fine", "id": 7, "max_tokens": 3.0, "temperature": 0.5, "seed": 1, "priority": 2},
        {"prompt": ""},
        {"prompt": 12},
        {"other": "no prompt"},
        {"prompt": "x", "max_tokens": "many"},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "lora": "missing"},
        {"prompt": "x", "lora": "known"},
    ]
    prepared = _prepare(tmp_path, rows, job)
    errors = [row.error for row in prepared.rows]
    assert errors[0] is None and prepared.rows[0].id == "7" and prepared.rows[1].id == "s:1"
    params = prepared.rows[0].request.params
    assert (params.max_tokens, params.temperature, params.seed, prepared.rows[0].request.priority) == (3, 0.5, 1, 2)
    assert errors[1] == "the prompt is empty"
    assert "prompt must be a string, got int" in errors[2]
    assert "no prompt" in errors[3]
    assert "max_tokens must be an integer, got 'many'" in errors[4]
    assert "top_p" in errors[5]
    assert "unknown LoRA adapter 'missing'; known adapters: known" in errors[6]
    assert errors[7] is None and prepared.rows[7].request.lora_request.lora_name == "known"


def test_chat_rows_need_well_formed_messages(tmp_path, make_job):
    good = [{"role": "user", "content": "hi"}]
    rows = [{"messages": good}, {"messages": json.dumps(good)}, {"messages": []},
            {"messages": [{"role": "user"}]}, {"messages": "not json"}, {"messages": None}]
    prepared = _prepare(tmp_path, rows, make_job(task="chat"))
    assert prepared.rows[0].request.messages == good and prepared.rows[1].request.messages == good
    assert all("messages" in row.error for row in prepared.rows[2:])


def test_embed_rows_use_pooling_params(tmp_path, make_job):
    prepared = _prepare(tmp_path, [{"prompt": "a"}], make_job(task="embed", pooling={"dimensions": 8}))
    assert prepared.rows[0].request.params == PoolingParams(dimensions=8)


def test_shards_without_the_needed_columns_fail(tmp_path, make_job):
    with pytest.raises(ShardError, match=r"no 'prompt' column, which task=generate needs \(columns: text\)"):
        _prepare(tmp_path, [{"text": "a"}], make_job())
    with pytest.raises(ShardError, match=r"no 'messages' column"):
        _prepare(tmp_path, [{"prompt": "a"}], make_job(task="chat"))
    with pytest.raises(ShardError, match=r"pass-through column\(s\) 'topic' not in the shard"):
        _prepare(tmp_path, [{"prompt": "a"}], make_job(pass_through=["topic"]))


def test_job_validation_names_bad_values(make_job):
    with pytest.raises(ValueError, match="unknown engine option.*'max_seqs'"):
        make_job(engine_options={"max_seqs": 4})
    with pytest.raises(ValueError, match="would overwrite output columns"):
        make_job(pass_through=["text"])
