"""`shardline run` over a hybrid model needs nothing special: a tiny Qwen3.5-style
model (gated delta-net and full attention) runs a local dataset end to end, and its
rows carry the engine's own greedy text."""

from __future__ import annotations

import pyarrow.parquet as pq

from shardline import LLM, SamplingParams
from shardline.cli import main
from shardline.engine.model.tiny import build_tiny_model
from shardline.tasks.sample_data import write_sample_dataset

from .test_hybrid_parity import ARCHS


def test_shardline_run_over_a_qwen3_5_model(tmp_path, prefect_harness, capsys):
    model_dir = str(build_tiny_model(tmp_path / "model", "qwen3_5_text", **ARCHS["qwen3_5_text"]))
    write_sample_dataset(str(tmp_path / "in"), num_shards=1, rows_per_shard=3)
    argv = ["run", str(tmp_path / "in"), str(tmp_path / "out"), "--model", model_dir, "--max-tokens", "4",
            "--temperature", "0", "--engine-options", '{"dtype": "float32"}']
    assert main(argv) == 0
    assert "1 done/0 skipped/0 failed" in capsys.readouterr().out
    [shard] = sorted((tmp_path / "out").glob("*.parquet"))
    rows = {row["id"]: row for row in pq.read_table(shard).to_pylist()}
    source = [row for row in pq.read_table(next((tmp_path / "in").glob("*.parquet"))).to_pylist()
              if rows[row["id"]]["error"] is None]  # the sample data's deliberate bad row aside
    assert len(source) == 3
    llm = LLM(model_dir, dtype="float32")
    expected = llm.generate([row["prompt"] for row in source], SamplingParams(temperature=0, max_tokens=4),
                            use_tqdm=False)
    assert [rows[row["id"]]["text"] for row in source] == [output.outputs[0].text for output in expected]
