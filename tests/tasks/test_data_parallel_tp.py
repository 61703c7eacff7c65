"""Data parallelism over tensor-parallel replicas: each replica gets its own group of
tensor_parallel_size devices (the placement), and on CPU two replicas of two ranks each
(four engine processes) write the shards one engine writes, row for row."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from shardline.cli import main
from shardline.tasks.replicas import place_replicas
from shardline.tasks.sample_data import write_sample_dataset


def test_each_replica_gets_its_own_device_group():
    placements = place_replicas(2, 2, ["0", "1", "2", "3"], cpus=16)
    assert [p.cuda_devices for p in placements] == [("0", "1"), ("2", "3")]
    # Visible devices named by CUDA_VISIBLE_DEVICES: the groups follow their order, one device each once.
    placements = place_replicas(3, 2, ["4", "5", "6", "7", "2", "3"], cpus=16)
    assert [p.cuda_devices for p in placements] == [("4", "5"), ("6", "7"), ("2", "3")]
    assert all(p.threads is None for p in placements)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 with 4 device\(s\) per replica needs 8 CUDA "
                                         r"devices; 6 are visible \(4, 5, 6, 7, 2, 3\)"):
        place_replicas(2, 4, ["4", "5", "6", "7", "2", "3"], cpus=16)
    # On CPU, the host's threads shared among the replicas (each replica's ranks share its own).
    assert [(p.cuda_devices, p.threads) for p in place_replicas(2, 2, [], cpus=8)] == [(None, 4), (None, 4)]
    assert [p.threads for p in place_replicas(4, 2, [], cpus=2)] == [1, 1, 1, 1]


def _run(tiny_model: str, inputs: str, output: str, *flags: str) -> list[list[dict]]:
    options = json.dumps({"max_num_seqs": 4, "max_model_len": 96, "device": "cpu", "dtype": "float32"})
    assert main(["run", inputs, output, "--model", tiny_model, "--max-tokens", "6", "--temperature", "0",
                 "--engine-options", options, *flags]) == 0
    return [pq.read_table(f"{output}/part-{i:05d}.parquet").to_pylist() for i in range(3)]


@pytest.mark.slow
def test_two_replicas_of_two_ranks_write_one_engines_shards(tiny_model, tmp_path):
    inputs = str(tmp_path / "in")
    write_sample_dataset(inputs, num_shards=3, rows_per_shard=6)
    expected = _run(tiny_model, inputs, str(tmp_path / "one"))
    got = _run(tiny_model, inputs, str(tmp_path / "dp-tp"), "--data-parallel-size", "2",
               "--tensor-parallel-size", "2")
    columns = ("id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "error")
    assert [[{c: row[c] for c in columns} for row in shard] for shard in got] == \
        [[{c: row[c] for c in columns} for row in shard] for shard in expected]
    texts = [row["text"] for shard in expected for row in shard if row["error"] is None]
    assert len(set(texts)) > 5 and any(row["error"] for shard in expected for row in shard)
