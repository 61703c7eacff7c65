"""LoRA adapters split over tensor-parallel ranks as their layers are: two adapters and
requests without one in the same batches on 2 gloo ranks give 1 rank's greedy tokens
and those of transformers with each adapter merged (peft); each rank's slots hold its
share of each adapter."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from shardline import LLM, LoRARequest, SamplingParams
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.lora.layers import BatchedLoRALinear
from shardline.engine.model.tiny import build_tiny_model

from ..hf_reference import hf_greedy, load_hf_model
from ..lora.test_lora import make_adapter, merged_model
from .test_tensor_parallel import MAX_TOKENS, OPTIONS, prompts_for, rank_processes

LORA_OPTIONS = dict(OPTIONS, enable_lora=True, max_loras=2, max_lora_rank=8)


def generate(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=MAX_TOKENS,
                           temperature=0), use_tqdm=False, lora_request=loras)
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_two_adapters_in_one_batch_on_two_ranks(tmp_path):
    """Adapter "all" adapts every linear (column shares: q/k/v/gate/up keep B's rows;
    row shares: o/down keep A's columns, their deltas summed once with the base's
    partial products); adapter "some" q_proj, v_proj and down_proj only."""
    model_dir = str(build_tiny_model(tmp_path / "model", "llama"))
    paths = {"all": make_adapter(model_dir, tmp_path / "all", seed=1, r=8, lora_alpha=16, target_modules="all-linear"),
             "some": make_adapter(model_dir, tmp_path / "some", seed=2, r=4, lora_alpha=8,
                                  target_modules=["q_proj", "v_proj", "down_proj"])}
    requests = {name: LoRARequest(name, index, path) for index, (name, path) in enumerate(paths.items(), start=1)}
    references: dict[str | None, PreTrainedModel] = {name: merged_model(model_dir, path)
                                                     for name, path in paths.items()}
    references[None] = load_hf_model(model_dir)
    prompts = prompts_for(512)
    names = ["all", None, "some", "all", "some", None, "all", "some"]
    expected = [hf_greedy(references[name], prompt, MAX_TOKENS) for name, prompt in zip(names, prompts)]
    same_prompt = [hf_greedy(references[name], prompts[0], MAX_TOKENS) for name in references]
    assert len({tuple(tokens) for tokens in same_prompt}) == 3  # each adapter changes the tokens
    loras = [requests[name] if name else None for name in names]
    one_rank = LLM(model_dir, **LORA_OPTIONS)
    try:
        assert generate(one_rank, prompts, loras) == expected
    finally:
        one_rank.close()
    two_ranks = LLM(model_dir, tensor_parallel_size=2, **LORA_OPTIONS)
    processes = rank_processes(two_ranks)
    try:
        assert generate(two_ranks, prompts, loras) == expected
        engine = two_ranks.llm_engine
        assert isinstance(engine, LLMEngine) and engine.runner.lora_manager is not None
        layers = engine.runner.lora_manager.layers
        q_proj, o_proj = layers["model.layers.0.self_attn.q_proj"], layers["model.layers.0.self_attn.o_proj"]
        assert isinstance(q_proj, BatchedLoRALinear) and isinstance(o_proj, BatchedLoRALinear)
        assert (q_proj.in_features, q_proj.out_features) == (64, 32)  # half the query heads' rows
        assert (o_proj.in_features, o_proj.out_features) == (32, 64)  # half the input columns
        assert q_proj.adapted_features == o_proj.adapted_features == (64, 64)
        slot = engine.runner.lora_manager.slot_of(requests["all"].lora_int_id)
        assert slot is not None and bool(torch.any(o_proj.lora_a[slot] != 0))
    finally:
        two_ranks.close()
    assert not any(process.is_alive() for process in processes)
