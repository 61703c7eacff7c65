"""Hybrid models (attention beside recurrent layers) give transformers' greedy tokens.

For each model type with a recurrent kind (engine/recurrent/), built tiny and random:
prompts of several lengths in one batch, a 16-token budget (prefill chunks continue a
saved state across steps), a cache of a few blocks (preemption restarts a request's
state from zero), n = 2 (the second sample forks the first's state) and an abort in
mid-decode; every state slot is free afterwards (a model without attention layers
keeps no KV blocks, so nothing preempts it). Float64 (transformers runs the gated
delta rule and Mamba's decode update itself in float32), except the MoE types, whose
expert code in transformers takes no float64: float32 there.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.model.kv_cache_spec import KVCacheSpec
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.recurrent.state import RecurrentStateSpec, install_recurrent_layers

from ..hf_reference import hf_greedy, random_prompts

MAX_NEW_TOKENS = 6
MAX_MODEL_LEN = 64
NUM_SLOTS = 4
NUM_BLOCKS = 6  # the prompts below need 9 blocks of 16 at once: preemption

_GDN = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"])
_MAMBA = dict(intermediate_size=128, state_size=8, time_step_rank=4, conv_kernel=4)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_d_state=8, mamba_n_groups=2,
               mamba_chunk_size=4, mamba_d_conv=4)
_KDA = dict(linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, num_key_value_heads=4,
            layer_types=["linear_attention", "full_attention"])
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
ARCHS = {
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]),
    "lfm2_moe": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1),
    "lfm3": dict(num_hidden_layers=3, layer_types=["conv", "sliding_attention", "full_attention"],
                 sliding_window=8),
    "qwen3_next": {**_GDN, **_MOE},
    "qwen3_5_text": _GDN,
    "qwen3_5_moe_text": {**_GDN, **_MOE},
    "mamba": _MAMBA,
    "falcon_mamba": _MAMBA,
    "jamba": dict(mamba_expand=2, mamba_d_state=8, mamba_dt_rank=4, mamba_d_conv=4, attn_layer_period=2,
                  attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                  num_experts_per_tok=2),
    "mamba2": dict(num_heads=8, head_dim=16, expand=2, state_size=8, n_groups=2, chunk_size=4, conv_kernel=4),
    "bamba": dict(_MAMBA2, attn_layer_indices=[1]),
    "granitemoehybrid": dict(_MAMBA2, layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=4,
                       conv_kernel=4, layers_block_type=["mamba", "attention", "mlp"], num_hidden_layers=3,
                       head_dim=16),
    "minimax": dict(head_dim=16, block_size=4, layer_types=["linear_attention", "full_attention"],
                    num_local_experts=4, num_experts_per_tok=2),
    "kimi_linear": dict(_KDA),
    "bailing_hybrid": dict(_KDA),
    # Two hybrid layers calling the shared attention block, each with its own cache.
    "zamba": dict(mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2, num_hidden_layers=4,
                  layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),
    "zamba2": dict(n_mamba_heads=8, mamba_headdim=16, mamba_expand=2, mamba_d_state=8, mamba_ngroups=2, chunk_size=4,
                   mamba_d_conv=4, layers_block_type=["mamba", "hybrid"]),
    "falcon_h1": dict(_MAMBA2, mamba_d_ssm=128, head_dim=16),
    "recurrent_gemma": dict(lru_width=64, conv1d_width=4, num_hidden_layers=3, attention_window_size=8,
                            head_dim=16),
    # Its gated delta-net's own projections and doubled beta (linear_allow_neg_eigval, on by default).
    "olmo_hybrid": {name: value for name, value in _GDN.items() if name != "head_dim"},
    "lara_mini": {**_GDN, **_MOE, "num_hidden_layers": 4, "sliding_window": 8,
                  "layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
    # Its CCA projections' state (convolved queries and keys, delayed values) beside full and sliding attention.
    "zaya": dict(num_hidden_layers=2, layer_types=["hybrid", "hybrid_sliding"], sliding_window=8, cca_time0=3,
                 num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32, head_dim=16),
}
FLOAT32 = {"lfm2_moe", "qwen3_next", "qwen3_5_moe_text", "jamba", "granitemoehybrid", "minimax", "kimi_linear",
           "lara_mini", "zaya"}


# qwen3_5_text (gated delta-net and full attention) runs by default; the others are
# slow-marked (tests/engine/recurrent/test_gated_delta_net.py checks the short-conv kind
# against its module by default).
FAST = {"qwen3_5_text"}


@pytest.fixture(scope="module", params=[arch if arch in FAST else pytest.param(arch, marks=pytest.mark.slow)
                                        for arch in sorted(ARCHS)])
def hybrid_case(request, tmp_path_factory):
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
    # The wrappers run the HF modules themselves outside the engine, so the reference is unchanged.
    per_slot = RecurrentStateSpec.from_layers(install_recurrent_layers(hf_model)).bytes_per_slot()
    per_block = KVCacheSpec.from_hf_config(hf_model.config, getattr(torch, dtype)).bytes_per_block(16)
    engine_options = dict(dtype=dtype, kv_cache_memory_bytes=NUM_BLOCKS * per_block + NUM_SLOTS * per_slot)
    return arch, model_dir, prompts, expected, engine_options, per_block > 0


def _engine(model_dir: str, engine_options: dict) -> LLM:
    return LLM(model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_SLOTS, max_num_batched_tokens=16,
               **engine_options)


def _assert_slots_free(llm: LLM) -> None:
    slots = llm.llm_engine.scheduler.state_slots
    assert slots.num_slots == NUM_SLOTS and slots.num_free == NUM_SLOTS


def test_chunked_preempted_and_forked_requests_match_transformers(hybrid_case):
    _, model_dir, prompts, expected, engine_options, attends = hybrid_case
    llm = _engine(model_dir, engine_options)
    if attends:  # a model without attention layers keeps no KV: its blocks are free, nothing preempts
        # at most NUM_BLOCKS: prefix caching's state snapshots take their slots from the blocks' budget
        assert 0 < llm.llm_engine.scheduler.config.num_blocks <= NUM_BLOCKS
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, n=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outputs] == [[want, want] for want in expected]
    assert sum(o.metrics.num_preemptions for o in outputs) > 0 or not attends
    _assert_slots_free(llm)


def test_an_abort_in_mid_decode_leaves_the_others_exact(hybrid_case):
    _, model_dir, prompts, expected, engine_options, attends = hybrid_case
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


def test_a_step_that_fails_mid_model_is_recomputed_exactly(hybrid_case):
    """The recurrent layers before the failing one have advanced their state: the
    engine restarts the step's requests from token 0, so the tokens stay exact."""
    _, model_dir, prompts, expected, engine_options, _ = hybrid_case
    llm = _engine(model_dir, engine_options)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    for index, prompt in enumerate(prompts[1:3]):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    engine.step()  # a first prefill chunk, so the failing step continues saved state

    def fail(module, args, output):
        raise RuntimeError("injected failure after the other layers ran")

    last_layer = engine.runner.model.base_model.layers[-1]  # model.model, or backbone (Mamba)
    hook = last_layer.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.step()
    hook.remove()
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step()})
    assert finished == {"0": expected[1], "1": expected[2]}
    _assert_slots_free(llm)
