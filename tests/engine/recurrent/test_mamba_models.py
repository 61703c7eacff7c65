"""Models built on the Mamba-2, Mamba-1, lightning and Kimi delta kinds give
transformers' greedy tokens through the engine.

Each type, built tiny and random: prompts of several lengths in one batch, a 16-token
budget (prefill chunks continue a saved state across steps), a cache of a few blocks
(preemption restarts a request's state from zero), n = 2 (the second sample forks the
first's state) and an abort in mid-decode; every state slot is free afterwards.
Float64, except the types whose mixture-of-experts code in transformers takes no
float64. One type runs by default; the others are slow-marked (same kinds, other
wiring).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.recurrent.state import RecurrentStateSpec, install_recurrent_layers
from shardline.engine.tiny import build_tiny_model

from ..hf_reference import hf_greedy, random_prompts

MAX_NEW_TOKENS = 6
MAX_MODEL_LEN = 64
NUM_SLOTS = 4
NUM_BLOCKS = 6  # the prompts below need 9 blocks of 16 at once: preemption

_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_expand=2, mamba_d_state=16, mamba_n_groups=2,
               mamba_chunk_size=8)
ARCHS = {
    "bamba": dict(num_hidden_layers=2, attn_layer_indices=[1], **_MAMBA2),
    "granitemoehybrid": dict(num_hidden_layers=2, layer_types=["mamba", "attention"], num_local_experts=2,
                             num_experts_per_tok=1, **_MAMBA2),
    "falcon_h1": dict(num_hidden_layers=2, mamba_d_ssm=128, head_dim=16, **_MAMBA2),
    "zamba2": dict(num_hidden_layers=2, n_mamba_heads=4, mamba_headdim=32, mamba_expand=2, mamba_d_state=16,
                   mamba_ngroups=2, chunk_size=8, layers_block_type=["mamba", "hybrid"], attention_head_dim=16),
    # Mamba-1 without attention layers; lightning attention; Kimi delta attention.
    "mamba": dict(num_hidden_layers=2, intermediate_size=128, state_size=8, time_step_rank=8),
    "minimax": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], head_dim=16,
                    block_size=8, num_local_experts=2, num_experts_per_tok=1),
    "kimi_linear": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_num_heads=2,
                        linear_head_dim=16, num_key_value_heads=4),
}
FLOAT32 = {"granitemoehybrid", "minimax", "kimi_linear"}
FAST = {"bamba"}


@pytest.fixture(scope="module", params=[arch if arch in FAST else pytest.param(arch, marks=pytest.mark.slow)
                                        for arch in sorted(ARCHS)])
def model_case(request, tmp_path_factory):
    """A tiny model, its prompts, transformers' greedy tokens and the cache budget
    that holds NUM_SLOTS state slots and NUM_BLOCKS KV blocks."""
    arch = request.param
    dtype = "float32" if arch in FLOAT32 else "float64"
    model_dir = str(build_tiny_model(tmp_path_factory.mktemp(arch), arch, **ARCHS[arch]))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
    prompts = random_prompts(4, (3, 40), 500, seed=3)
    prompts[0] = prompts[0][:3]
    expected = [hf_greedy(hf_model, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    per_slot = RecurrentStateSpec.from_layers(install_recurrent_layers(hf_model)).bytes_per_slot()
    per_block = KVCacheSpec.from_hf_config(hf_model.config, getattr(torch, dtype)).bytes_per_block(16)
    engine_options = dict(dtype=dtype, kv_cache_memory_bytes=NUM_BLOCKS * per_block + NUM_SLOTS * per_slot)
    # A model without attention layers keeps no KV blocks, so nothing preempts it.
    return model_dir, prompts, expected, engine_options, per_block > 0


def _engine(model_dir: str, engine_options: dict) -> LLM:
    return LLM(model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_SLOTS, max_num_batched_tokens=16,
               **engine_options)


def _assert_slots_free(llm: LLM) -> None:
    slots = llm.llm_engine.scheduler.state_slots
    assert slots.num_slots == NUM_SLOTS and slots.num_free == NUM_SLOTS


def test_chunked_preempted_and_forked_requests_match_transformers(model_case):
    model_dir, prompts, expected, engine_options, has_kv_blocks = model_case
    llm = _engine(model_dir, engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, n=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outputs] == [[want, want] for want in expected]
    assert (sum(o.metrics.num_preemptions for o in outputs) > 0) == has_kv_blocks
    _assert_slots_free(llm)


def test_an_abort_in_mid_decode_leaves_the_others_exact(model_case):
    model_dir, prompts, expected, engine_options, _ = model_case
    llm = _engine(model_dir, engine_options)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    for index, prompt in enumerate(prompts[:3]):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    aborted = False
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finished[output.request_id] = list(output.outputs[0].token_ids)
        request = engine.scheduler.get_request("1")
        if not aborted and request is not None and request.num_output_tokens >= 2:
            engine.abort_request("1")
            aborted = True
    assert aborted and finished == {"0": expected[0], "2": expected[2]}
    _assert_slots_free(llm)
