"""Architectures whose attention transformers never routes through its
AttentionInterface run on the paged attention through adapters
(engine/model/adapters/): greedy tokens equal transformers' in float64, under chunked
prefill and decode, for each layout variant a config can select."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from shardline import LLM, SamplingParams
from shardline.engine.attention.backends import choose_attention_backend
from shardline.engine.model.adapters import PagedAttentionAdapter
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.parts.build import uses_position_bias

from ..hf_reference import hf_greedy, load_hf_model, random_prompts

MAX_NEW_TOKENS = 6

CASES = {
    "gpt_neo-local-window": ("gpt_neo", dict(attention_types=[[["local", "global"], 1]], window_size=6)),
    "falcon-rotary": ("falcon", dict(multi_query=False, new_decoder_architecture=False)),
    "falcon-multi-query": ("falcon", dict(multi_query=True, new_decoder_architecture=False)),
    "falcon-grouped": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "bloom-alibi": ("bloom", {}),
    "mpt-alibi": ("mpt", dict(attn_config=dict(alibi=True, clip_qkv=6.0))),
    "diffllama-two-value-sets": ("diffllama", {}),
    "gpt_neox_japanese-partial-rotary": ("gpt_neox_japanese", dict(rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
}


@pytest.mark.parametrize("case", CASES)
def test_adapted_architecture_matches_transformers(case, tmp_path):
    arch, overrides = CASES[case]
    model_dir = str(build_tiny_model(tmp_path, arch, **overrides))
    prompts = random_prompts(3, (2, 200), 512, seed=3)  # past 8 bits of position and the windows
    reference = load_hf_model(model_dir)
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    llm = LLM(model_dir, dtype="float64", max_num_batched_tokens=16)  # prompts cross chunks
    adapters = [m for m in llm.llm_engine.model.modules() if isinstance(m, PagedAttentionAdapter)]
    assert len(adapters) == 2  # one per decoder layer
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.close()
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_an_adapter_keeps_the_original_parameter_names(tmp_path):
    from shardline.engine.model.adapters import adapt_attention

    model = load_hf_model(str(build_tiny_model(tmp_path, "bloom")))
    names = {name for name, _ in model.named_parameters()}
    assert adapt_attention(model) == 2
    assert {name for name, _ in model.named_parameters()} == names
    assert all(isinstance(layer.self_attention, nn.Module) for layer in model.transformer.h)


# falcon with alibi=True: 16 heads, so most slopes are not powers of two and the
# model's bfloat16 products differ from slope * position from position 3 on (a
# slope-only ALiBi fails the load check). case -> (layout, dtype, attention backend):
# float32 on the "cpu" backend takes the native decode kernel for the step, which the
# ALiBi layers must leave for the torch path.
FALCON_ALIBI = {
    "falcon-alibi": (dict(multi_query=False, new_decoder_architecture=False), "float64", None),
    "falcon-alibi-multi-query": (dict(multi_query=True, new_decoder_architecture=False), "float64", None),
    "falcon-alibi-float32-cpu": (dict(multi_query=False, new_decoder_architecture=False), "float32", "cpu"),
}


@pytest.mark.parametrize("case", FALCON_ALIBI)
def test_falcon_with_alibi_matches_transformers_sdpa(case, tmp_path):
    """transformers' SDPA attention is the reference (falcon's default there): it adds the
    ALiBi bias once, where its eager attention adds it twice."""
    layout, dtype, backend = FALCON_ALIBI[case]
    model_dir = str(build_tiny_model(tmp_path, "falcon", alibi=True, num_attention_heads=16, **layout))
    prompts = random_prompts(3, (2, 200), 512, seed=3)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    # The load check runs, and passes; prompts cross chunks.
    llm = LLM(model_dir, dtype=dtype, max_num_batched_tokens=16, attention_backend=backend)
    assert uses_position_bias(llm.llm_engine.model)  # so CUDA engines take the torch path
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.close()
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_a_bias_table_takes_the_torch_path_on_cuda_and_the_triton_backend_refuses_it():
    """Only the torch attention path takes a bias table by key position: an engine on
    CUDA chooses it for such a model, and asking for Triton is one clear error."""
    cuda = torch.device("cuda")
    backend = choose_attention_backend(None, cuda, torch.float32, 16, native_decode=False, native_prefill=False,
                                       position_bias=True)
    assert backend.name == "torch"
    with pytest.raises(ValueError, match="bias table by key position"):
        choose_attention_backend("triton", cuda, torch.float32, 16, native_decode=False, native_prefill=False,
                                 position_bias=True)


# Models whose attention modules are called several times per token, each call
# attending a cache layer of its own that its caller names (CallIndexedAttention), and
# the attention cache layers each needs: zamba's one shared block, called by its 2
# hybrid layers; hrm_text, whose config counts one layer per pass (2 per stack x 2 high
# cycles x (2 low cycles + its high pass)); dory, with a copy of its 2-layer recurrent
# section for its second loop.
CALL_CASES = {
    "zamba-shared-block": ("zamba", dict(mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2, num_hidden_layers=4,
                                         layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]), 2),
    "hrm_text-cycles": ("hrm_text", dict(H_cycles=2, L_cycles=2, head_dim=16), 12),
    "dory-loops": ("dory", dict(num_hidden_layers=4, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1,
                                n_recurrent_loops=2, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                             "full_attention"]), 6),
}


@pytest.mark.parametrize("case", CALL_CASES)
def test_attention_called_several_times_per_token_keeps_a_cache_layer_per_call(case, tmp_path):
    arch, overrides, num_attention_layers = CALL_CASES[case]
    model_dir = str(build_tiny_model(tmp_path, arch, **overrides))
    prompts = random_prompts(3, (2, 40), 512, seed=3)
    reference = load_hf_model(model_dir)
    expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    llm = LLM(model_dir, dtype="float64", max_num_batched_tokens=16)  # prompts cross chunks
    assert sum(layer.num_kv_heads > 0 for layer in llm.llm_engine.runner.spec.layers) == num_attention_layers
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.close()
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_dory_whose_earlier_loops_only_read_the_cache_is_refused_with_the_reason(tmp_path):
    from shardline.engine.errors import UnsupportedModelError

    arch, overrides, _ = CALL_CASES["dory-loops"]
    model_dir = str(build_tiny_model(tmp_path, arch, **overrides, recurrent_kv_cache_mode="last_loop"))
    with pytest.raises(UnsupportedModelError, match="recurrent_kv_cache_mode 'last_loop'"):
        LLM(model_dir, dtype="float64")
