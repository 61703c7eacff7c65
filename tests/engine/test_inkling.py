"""inkling (engine/model/adapters/inkling.py): attention layers whose keys, values,
attention output and MLP output pass through short convolutions, the convolutions'
inputs cached per token in cache layers of their own, and a relative position bias each query
computes from its hidden state; greedy tokens equal transformers' through chunked
prefill (chunks reading their predecessors' convolution inputs from the cache),
preemption, prefix-cache hits and the windowed block groups (the sliding layers', the
convolution inputs').

The tiny model's sliding layers have their own head counts and sizes, the bias reaches
past their window (rel_extent 12, window 8) and the full layer scales its queries and
bias logarithmically from position 4 on.
"""

from __future__ import annotations

import torch
import transformers

from shardline import LLM
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.tiny import build_tiny_model

from .coverage import tiny_overrides
from .hf_reference import assert_exact_through_preemption_and_hits, hf_greedy, random_prompts

LAYERS = ["hybrid_sliding", "hybrid", "hybrid_sliding"]


def test_inkling_equals_transformers_through_chunks_preemption_and_prefix_hits(tmp_path):
    overrides = {**tiny_overrides("inkling_text"), "num_hidden_layers": 3, "layer_types": LAYERS}
    model_dir = str(build_tiny_model(tmp_path, "inkling_text", **overrides))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = random_prompts(6, (2, 30), 512, seed=38, shared_prefix=21)
    expected = [hf_greedy(reference, prompt, 8) for prompt in prompts]
    assert len({tuple(tokens) for tokens in expected}) > 1  # the tokens depend on the prompt
    spec = KVCacheSpec.from_hf_config(reference.config, torch.float32)
    # Per token each layer's keys and values, then in a layer of its own (a window of
    # conv_kernel_size tokens) its raw keys and values, attention and MLP outputs.
    hidden, kernel = reference.config.hidden_size, reference.config.conv_kernel_size
    assert [(layer.head_dim, layer.value_head_dim, layer.sliding_window) for layer in spec.layers] == [
        (8, 8, 8), (2 * 16, 2 * 16, None), (8, 8, 8), (2 * 8, 2 * hidden, kernel), (2 * 2 * 16, 2 * hidden, kernel),
        (2 * 8, 2 * hidden, kernel)]
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=16, max_num_seqs=3, max_model_len=64,
              kv_cache_memory_bytes=6 * spec.bytes_per_block(16))
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    windowed = engine.runner.windowed
    # The sliding layers and the convolution inputs free the blocks no later query reads.
    assert windowed is not None and windowed.layer_groups == (1, 0, 1, 2, 2, 2)
    # The rerun: convolution inputs come back with cached blocks.
    assert_exact_through_preemption_and_hits(llm, prompts, expected, rerun=2)
    llm.close()
