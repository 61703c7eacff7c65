"""Tensor-parallel ranks take the CPU fast paths a split model runs, rank 0's choice on
every rank, with one rank's tokens; rank 0's process gets its torch threads back when
the group closes."""

from __future__ import annotations

import torch

from shardline import LLM
from shardline.engine.cpu.linear import PackedLinear
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.parallel.layers import RowParallelLinear
from shardline.engine.parallel.ranks import RANK_CPU_PATHS

from .test_tensor_parallel import OPTIONS, generate, prompts_for, rank_processes


def test_ranks_take_the_cpu_paths_and_give_the_threads_back(tmp_path, monkeypatch):
    # Taken wherever the host runs them, without measuring: the choice is the host's alone.
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "packed_linears=on,decode_kernel=on,prefill_kernel=on")
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    threads = torch.get_num_threads()
    prompts = prompts_for(512)
    one_rank = LLM(model_dir, **OPTIONS)
    assert isinstance(one_rank.llm_engine, LLMEngine)
    expected, tokens = one_rank.llm_engine.cpu_paths, generate(one_rank, prompts)
    one_rank.close()
    assert len({tuple(t) for t in tokens}) > 1  # the tokens depend on the prompt
    two_ranks = LLM(model_dir, tensor_parallel_size=2, **OPTIONS)
    processes = rank_processes(two_ranks)
    assert generate(two_ranks, prompts) == tokens
    assert torch.get_num_threads() == max(1, threads // 2)
    engine = two_ranks.llm_engine
    assert isinstance(engine, LLMEngine)
    paths = engine.cpu_paths
    assert expected.packed_linears or expected.decode_kernel, "this host takes none of the paths"
    for name in RANK_CPU_PATHS:
        assert getattr(paths, name) == getattr(expected, name), name
    assert not paths.fused_kernels and "tensor-parallel" in dict(paths.reasons)["fused_kernels"]
    model = engine.runner.model
    if paths.packed_linears:  # each share packed, the row-split sums kept outside
        rows = [module for module in model.modules() if isinstance(module, RowParallelLinear)]
        assert rows and all(isinstance(module.linear, PackedLinear) for module in rows)
    two_ranks.close()
    assert not any(process.is_alive() for process in processes)
    assert torch.get_num_threads() == threads
