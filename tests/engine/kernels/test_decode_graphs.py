"""The decode path over static buffers (what CUDA graphs replay) gives the same
tokens as the packed path. Without CUDA it runs eagerly, Triton kernels through the
interpreter, so the padding rows (no KV write, no query, no context), the int32
indices and the block tables are checked here; a GPU replays the same buffers."""

from __future__ import annotations

import pytest
import torch

from shardline import LLM, SamplingParams
from shardline.engine.model.cuda_graphs import DecodeGraphs, capture_sizes
from shardline.engine.model.tiny import build_tiny_model

from ..hf_reference import random_prompts


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256]
    assert capture_sizes(4096)[-1] == 512


# gemma2 on one table runs with the slow set; the next test keeps windowed groups off the static path.
@pytest.mark.parametrize("arch", ["llama", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_static_decode_path_matches_packed_path(tmp_path, arch, monkeypatch):
    """gemma2 with one block table (free_windowed_blocks=False): the static buffers hold
    one table, so with windowed groups the static path is not taken (the next test)."""
    runs = []
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run",
                        lambda self, out, *args: runs.append(len(out.scheduled)) or run(self, out, *args))
    model_dir = str(build_tiny_model(tmp_path / arch, arch))
    # Five requests: padded to 8 rows; different lengths finish at different steps,
    # so later steps pad more rows; n=2 forks share blocks.
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, (20, 70), 512, seed=5)]
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True, logprobs=1)
              for i in range(5)]
    params[1] = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=4, ignore_eos=True)
    results = {}
    for static in (False, True):
        llm = LLM(model_dir, dtype="float32", max_num_seqs=6, enforce_eager=not static, attention_backend="triton",
                  free_windowed_blocks=False)
        runner = llm.llm_engine.runner
        if static and runner.decode_graphs is None:  # no CUDA: the same buffers, run eagerly
            runner.enable_decode_graphs(6, llm.llm_engine.max_model_len, capture=False)
        assert bool(static and runner.decode_graphs.graphs) == (static and torch.cuda.is_available())
        results[static] = llm.generate(prompts, params, use_tqdm=False)
    assert runs and max(runs) == 6 and min(runs) < 6  # the static path ran, also with padding rows
    for packed, static in zip(results[False], results[True]):
        for a, b in zip(packed.outputs, static.outputs):
            assert b.token_ids == a.token_ids
            if a.cumulative_logprob is not None:
                assert abs(b.cumulative_logprob - a.cumulative_logprob) < 1e-3


def test_windowed_groups_keep_decode_steps_off_the_static_path(tmp_path, monkeypatch):
    runs = []
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, out, *args: runs.append(out))
    model_dir = str(build_tiny_model(tmp_path / "gemma2", "gemma2", sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"]))
    llm = LLM(model_dir, dtype="float32", max_num_seqs=4, attention_backend="triton")
    runner = llm.llm_engine.runner
    assert runner.windowed is not None
    if runner.decode_graphs is None:
        runner.enable_decode_graphs(4, llm.llm_engine.max_model_len, capture=False)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, (20, 40), 512, seed=5)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert runs == []


def test_prefill_steps_do_not_qualify(tmp_path):
    model_dir = str(build_tiny_model(tmp_path / "llama", "llama"))
    llm = LLM(model_dir, dtype="float32")
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
    prefill = engine.scheduler.schedule()
    assert not DecodeGraphs.qualifies(prefill)


def test_static_decode_path_reads_pending_tokens_under_async_scheduling(tmp_path, monkeypatch):
    """With async scheduling, a decode step's inputs are the step in flight's sampled
    ids, copied into the static input buffer on the device."""
    pending_steps = []
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, out, packed, *args: pending_steps.append(
        len(packed.pending_positions)) or run(self, out, packed, *args))
    model_dir = str(build_tiny_model(tmp_path / "llama", "llama"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, (10, 40), 512, seed=6)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True) for i in range(4)]
    results = {}
    for static in (False, True):
        llm = LLM(model_dir, dtype="float32", max_num_seqs=4, enforce_eager=not static, attention_backend="triton",
                  async_scheduling=static)
        if static and llm.llm_engine.runner.decode_graphs is None:
            llm.llm_engine.runner.enable_decode_graphs(4, llm.llm_engine.max_model_len, capture=False)
        results[static] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert max(pending_steps) == 4  # every row of a full decode step read its input on the device
    assert results[True] == results[False]
