"""Models mixing sliding-window (or chunked) layers with full ones, run with each windowed
group's blocks freed once no query reads them (engine/core/window_blocks.py, on by
default): greedy tokens equal transformers' through chunked prefill, preemption, prefix
hits, duplicates and n > 1, on the torch path, the native CPU kernels and the Triton
kernel (through its interpreter)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.attention.context import AttentionContext, AttentionOptions
from shardline.engine.core.kv_cache import blocks_needed
from shardline.engine.core.window_blocks import WindowedKVCacheManager
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.kv_cache_spec import KVCacheSpec, plan_windowed_blocks
from shardline.engine.model.tiny import build_tiny_model

from .coverage_configs import tiny_overrides
from .hf_reference import hf_greedy, load_hf_model, random_prompts

SLIDING, FULL = "sliding_attention", "full_attention"
WINDOW = 12
BLOCK_SIZE = 4
MAX_TOKENS = 10
# Types whose transformers code does not run in float64 (grouped expert matmuls).
FLOAT32_REFERENCE = {"gpt_oss": "float32"}

CASES = {
    "gemma2": dict(num_hidden_layers=4, sliding_window=WINDOW, layer_types=[SLIDING, FULL] * 2),
    "gemma3_text": {**tiny_overrides("gemma3_text"), "num_hidden_layers": 4, "sliding_window": WINDOW,
                    "layer_types": [SLIDING, SLIDING, SLIDING, FULL]},
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, layer_types=[FULL, SLIDING]),
    "gpt_oss": {**tiny_overrides("gpt_oss"), "sliding_window": WINDOW},
    "llama4_text": {**tiny_overrides("llama4_text"), "attention_chunk_size": WINDOW},
    # Every layer windowed: the primary table holds no layer, it only counts each context.
    "ministral": {**tiny_overrides("ministral"), "sliding_window": WINDOW},
    # No layer types: every layer takes the config's window (layer_kinds reads them so).
    "mistral": dict(sliding_window=WINDOW),
    "phi3": dict(sliding_window=WINDOW),
}
# The budget, in requests of 100 tokens with one table, that makes the workload preempt.
BUDGET = {"ministral": 0.7, "mistral": 0.7, "phi3": 0.7}


def engine_of(llm: LLM) -> LLMEngine:
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    return engine


def workload(vocab_size: int) -> list[list[int]]:
    """Prompts longer than the window: four sharing a 30-token prefix (prefix hits), a
    duplicate of one of them, and three long unrelated ones."""
    shared = random_prompts(4, (3, 20), vocab_size, seed=5, shared_prefix=30)
    return [*shared, shared[1], *random_prompts(3, (50, 90), vocab_size, seed=6)]


def small_budget(model_dir: str, num_requests: float, dtype: torch.dtype) -> int:
    """A KV budget that holds ``num_requests`` requests of 100 tokens in one table."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    spec = KVCacheSpec.from_hf_config(config, dtype)
    return int(spec.bytes_per_block(BLOCK_SIZE) * num_requests * blocks_needed(100, BLOCK_SIZE))


@pytest.fixture(scope="module", params=list(CASES))
def windowed_model(request, tmp_path_factory) -> tuple[str, str, list[list[int]], list[list[int]]]:
    """(model dir, dtype, prompts, transformers' greedy tokens for each)."""
    arch = request.param
    model_dir = str(build_tiny_model(tmp_path_factory.mktemp(arch), arch, **CASES[arch]))
    dtype = FLOAT32_REFERENCE.get(arch, "float64")
    reference = (load_hf_model(model_dir) if dtype == "float64" else transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval())
    prompts = workload(reference.config.vocab_size)
    expected = [hf_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    vocab_size = reference.config.vocab_size
    other = [hf_greedy(reference, [3 + token % (vocab_size - 3) for token in prompt[:-1]] + prompt[-1:], MAX_TOKENS)
             for prompt in prompts[-3:]]  # every token but the last one changed
    assert other != expected[-3:], "the reference's tokens do not depend on the context"
    return model_dir, dtype, prompts, expected


def test_tokens_equal_transformers_with_chunks_preemption_prefix_hits_and_duplicates(windowed_model) -> None:
    model_dir, dtype, prompts, expected = windowed_model
    arch = transformers.AutoConfig.from_pretrained(model_dir).model_type
    llm = LLM(model_dir, dtype=dtype, block_size=BLOCK_SIZE, max_num_batched_tokens=16, max_model_len=128,
              kv_cache_memory_bytes=small_budget(model_dir, BUDGET.get(arch, 1.0), getattr(torch, dtype)),
              prefix_aware_admission=False)  # admitted in arrival order, growing requests preempt
    scheduler = engine_of(llm).scheduler
    assert isinstance(scheduler.kv_cache, WindowedKVCacheManager)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    assert scheduler.num_preemptions > 0
    assert scheduler.kv_cache.stats.num_hit_tokens > 0
    # Every block is back in its pool: nothing leaked across preemptions and forks.
    manager = scheduler.kv_cache
    assert all(pool.num_free_blocks == len(pool.blocks) - 1 for pool in manager.group_pools)
    llm.close()


def test_samples_of_one_prompt_fork_every_group(windowed_model) -> None:
    model_dir, dtype, prompts, expected = windowed_model
    llm = LLM(model_dir, dtype=dtype, block_size=BLOCK_SIZE, max_num_batched_tokens=32, max_model_len=128,
              enable_prefix_caching=False, collapse_duplicate_requests=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=3)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts[-2:]], params, use_tqdm=False)
    for output, want in zip(outputs, expected[-2:], strict=True):
        assert [list(sample.token_ids) for sample in output.outputs] == [want] * 3
    llm.close()


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=pytest.mark.slow)])
def test_kernels_read_each_groups_table(tmp_path, backend, monkeypatch) -> None:
    """float32 through the native CPU kernels, and the Triton kernel under
    TRITON_INTERPRET=1, give the torch path's tokens with windowed groups."""
    import shardline.engine.kernels as kernels
    from shardline.engine.kernels import cpu_attention, cpu_prefill_attention

    # The kernels this test is about, whatever SHARDLINE_CPU_PATHS the run was given.
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "decode_kernel=on,prefill_kernel=on")
    calls: list[str] = []
    for module, name in ((kernels, "paged_attention"), (cpu_attention, "decode_attention"),
                         (cpu_prefill_attention, "prefill_attention")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    model_dir = str(build_tiny_model(tmp_path / "gemma2", "gemma2", **CASES["gemma2"]))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, (40, 70), 500, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for name in ("torch", backend):
        llm = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, max_num_batched_tokens=16, max_model_len=128,
                  attention_backend=name)
        assert isinstance(engine_of(llm).scheduler.kv_cache, WindowedKVCacheManager)
        tokens[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.close()
    assert tokens[backend] == tokens["torch"]
    wanted = {"paged_attention"} if backend == "triton" else {"decode_attention", "prefill_attention"}
    assert wanted <= set(calls)


def test_turned_off_keeps_one_table(tmp_path) -> None:
    model_dir = str(build_tiny_model(tmp_path / "gemma2", "gemma2", **CASES["gemma2"]))
    llm = LLM(model_dir, dtype="float64", block_size=BLOCK_SIZE, max_model_len=128, free_windowed_blocks=False)
    assert not isinstance(engine_of(llm).scheduler.kv_cache, WindowedKVCacheManager)
    assert engine_of(llm).runner.windowed is None
    llm.close()


def test_a_layer_reaching_past_its_groups_span_is_refused() -> None:
    table = torch.zeros((1, 1), dtype=torch.int32)
    group = AttentionContext(slot_mapping=torch.zeros(1, dtype=torch.int64), query_start_loc=torch.tensor([0, 1]),
                             seq_lens=torch.tensor([1]), block_tables=table, kv_caches=[], max_query_len=1,
                             max_seq_len=1)
    ctx = replace(group, layer_groups=(1, 0), group_spans=(("sliding_window", 8),), group_contexts=(group,))
    assert ctx.for_layer(0, AttentionOptions(1.0, sliding_window=8)) is group
    assert ctx.for_layer(1, AttentionOptions(1.0)) is ctx
    with pytest.raises(ValueError, match="attention layer 0 attends with sliding_window=16.*span of 8 tokens"):
        ctx.for_layer(0, AttentionOptions(1.0, sliding_window=16))
    with pytest.raises(ValueError, match="attention layer 0 attends with sliding_window=None"):
        ctx.for_layer(0, AttentionOptions(1.0))


def test_plan_splits_the_budget_by_group() -> None:
    """Gemma 2's full layers read the primary table and its sliding ones their own, with
    fewer blocks; where every layer is windowed the primary table holds no layer."""
    mixed = KVCacheSpec.from_hf_config(transformers.Gemma2Config(
        num_hidden_layers=4, head_dim=16, sliding_window=64, layer_types=[SLIDING, FULL] * 2), torch.float32)
    budget = mixed.bytes_per_block(16) * 4 * blocks_needed(4096, 16)  # one table: 4 requests of 4096 tokens
    planned = plan_windowed_blocks(mixed, 16, 256, 4096, 512, budget)
    assert planned is not None
    primary, layout = planned
    assert layout.layer_groups == (1, 0, 1, 0) and layout.groups[0].span == 64
    assert primary >= 7 * blocks_needed(4096, 16) and layout.num_blocks[0] < primary
    sliding = KVCacheSpec.from_hf_config(transformers.AutoConfig.for_model(
        "ministral", **{**tiny_overrides("ministral"), "sliding_window": 64}), torch.float32)
    planned = plan_windowed_blocks(sliding, 16, 256, 4096, 512, budget)
    assert planned is not None and 0 not in planned[1].layer_groups
    assert plan_windowed_blocks(KVCacheSpec.from_hf_config(transformers.LlamaConfig(), torch.float32),
                                16, 256, 4096, 512, budget) is None
