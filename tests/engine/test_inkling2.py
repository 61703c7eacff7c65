"""inkling2 and inkling2_loop (engine/model/adapters/inkling2.py): inkling's cached
convolution inputs with scaled outputs, the full layers' dynamic convolution taps
projected from each token, attention sinks and gated outputs, attention over depth, and
the loop model's extra passes over its looped layers in cache layers of their own;
greedy tokens equal transformers' through 7-token chunks, preemption and prefix hits.
In float32: transformers' default experts (torch._grouped_mm) take no float64.

The tiny models' sliding layers have their own head counts and sizes, the bias reaches
past their window (rel_extent 12, window 8), the full layers scale queries and bias
states logarithmically from position 4 on, and blocks of attention over depth close
every 2 layers (every layer in the loop model, whose loop is layer 1, run twice).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.tiny import build_tiny_model

from .coverage import tiny_overrides
from .hf_reference import assert_exact_through_preemption_and_hits, hf_greedy, random_prompts

LAYERS = ["hybrid_sliding", "hybrid", "hybrid_sliding"]
# The coverage sweep's tiny sizes (tests/engine/coverage_configs.py), over three layers.
SMALL = dict(num_hidden_layers=3, layer_types=LAYERS)


def _exact_through_chunks_preemption_and_hits(tmp_path, model_type: str, dtype: torch.dtype) -> KVCacheSpec:
    """Build the tiny ``model_type``, check its reference depends on the context, and run
    the engine through 7-token chunks, a preemption and prefix hits; its cache spec."""
    overrides = {**tiny_overrides(model_type), **SMALL}
    model_dir = str(build_tiny_model(tmp_path, model_type, **overrides))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager").eval()
    prompts = random_prompts(5, (4, 30), 512, seed=41, shared_prefix=21)
    expected = [hf_greedy(reference, prompt, 8) for prompt in prompts]
    assert len({tuple(tokens) for tokens in expected}) > 1
    # The tokens depend on the context behind the sliding window: the tokens before the
    # last 9 changed, the continuation changes.
    changed = [token % 500 + 3 for token in prompts[0][:-9]] + prompts[0][-9:]
    assert hf_greedy(reference, changed, 8) != expected[0]
    spec = KVCacheSpec.from_hf_config(reference.config, dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    llm = LLM(model_dir, dtype=dtype_name, max_num_batched_tokens=7, max_num_seqs=3, max_model_len=64,
              kv_cache_memory_bytes=6 * spec.bytes_per_block(16))
    assert_exact_through_preemption_and_hits(llm, prompts, expected, rerun=2)
    llm.close()
    return spec


def test_inkling2_equals_transformers_through_chunks_preemption_and_prefix_hits(tmp_path):
    spec = _exact_through_chunks_preemption_and_hits(tmp_path, "inkling2_text", torch.float32)
    # Per token each layer's keys and values, then in a layer of its own (a window of
    # conv_kernel_size tokens) its raw keys and values, attention and MLP outputs.
    assert [(layer.head_dim, layer.value_head_dim, layer.sliding_window) for layer in spec.layers] == [
        (8, 8, 8), (32, 32, None), (8, 8, 8), (16, 128, 4), (64, 128, 4), (16, 128, 4)]


@pytest.mark.slow
def test_inkling2_loop_runs_its_looped_layers_in_cache_layers_of_their_own(tmp_path):
    spec = _exact_through_chunks_preemption_and_hits(tmp_path, "inkling2_loop_text", torch.float32)
    # Layer 1 twice: its second pass's keys and values, and its convolution inputs, follow.
    assert [(layer.head_dim, layer.sliding_window) for layer in spec.layers] == [
        (8, 8), (32, None), (8, 8), (32, None), (16, 4), (64, 4), (16, 4), (64, 4)]
