"""xLSTM's mLSTM as a recurrent kind: the packed mLSTM against transformers' own
backend from fresh and saved states, the layer kind against transformers' xLSTMLayer
under packed, chunked and decode schedules (both weight modes, chunks short enough
that the chunkwise form runs), and whole tiny models giving transformers' greedy
tokens with chunked prefill, n = 2 and prefix caching over template rows (a hit
continues from the state saved at its last block), with the C step loop and without.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.models.xlstm.modeling_xlstm import xLSTMBackend, xLSTMLayer

from shardline import LLM, SamplingParams
from shardline.engine.kernels.cpu_xlstm import mlstm_kernel_available
from shardline.engine.kernels.xlstm_mlstm import mlstm_varlen
from shardline.engine.llm_engine import LLMEngine
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.recurrent.state import RecurrentLayer
from shardline.engine.recurrent.xlstm import MLSTM, MlstmLayerKind

from ..hf_reference import hf_greedy, random_prompts
from .attention_free import (
    TinyModelCase,
    assert_chunked_and_forked_requests_match,
    assert_native_core_matches,
    assert_template_rows_match,
    tiny_model_case,
)
from .mixer_parity import chunked, make_sequences, prefill_then_decode, randomize, run_schedule, whole

LENGTHS = [9, 1, 23, 3, 6]
HEADS, DQK, DV, CHUNK = 2, 8, 16, 4
# qk_dim_factor 0.5 of 128 is 64: transformers' cache and its layers then agree on the key width.
TINY: dict[str, Any] = dict(hidden_size=128, embedding_dim=128, num_heads=4, num_hidden_layers=2, chunk_size=8)


def _packed(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[1, NH, L, ...] per sequence -> [sum L, NH, ...]."""
    return torch.cat([tensor[0].transpose(0, 1) for tensor in tensors])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_mlstm_matches_transformers_backend_from_saved_states(dtype):
    gen = torch.Generator().manual_seed(0)
    backend = xLSTMBackend(transformers.xLSTMConfig(hidden_size=32, num_heads=HEADS, chunk_size=CHUNK))
    has_state = [True, False, True, False, True]

    def draw(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=dtype) * scale

    inputs = [[draw(1, HEADS, n, DQK), draw(1, HEADS, n, DQK), draw(1, HEADS, n, DV), draw(1, HEADS, n, scale=3),
               draw(1, HEADS, n, scale=3)] for n in LENGTHS]
    saved = [(draw(1, HEADS, DQK, DV), draw(1, HEADS, DQK), draw(1, HEADS, 1)) for _ in LENGTHS]
    references = []
    for (q, k, v, i, f), state, keep in zip(inputs, saved, has_state):
        initial = dict(zip(("c_initial", "n_initial", "m_initial"), state)) if keep else {}
        references.append(backend(query=q, key=k, value=v, igate=i, fgate=f, **initial))
    c = torch.cat([state[0] for state in saved])
    n = torch.cat([state[1] for state in saved])
    m = torch.cat([state[2][..., 0] for state in saved])
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    q, k, v, i, f = (_packed([inp[j] for inp in inputs]) for j in range(5))
    h = mlstm_varlen(q, k, v, i, f, cu, torch.tensor(has_state), c, n, m, CHUNK, 1e-6, torch.float32)
    for b, (expected, (c_want, n_want, m_want)) in enumerate(references):
        torch.testing.assert_close(h[cu[b]:cu[b + 1]], expected[0].transpose(0, 1), msg=f"request {b} output")
        for name, got, want in (("c", c[b], c_want[0]), ("n", n[b], n_want[0]), ("m", m[b], m_want[0, :, 0])):
            torch.testing.assert_close(got, want.to(dtype), msg=f"request {b} state {name}")


def hf_layer_run(layer: torch.nn.Module, sequence: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' layer on one sequence from a fresh state: (output, final states)."""
    with torch.no_grad():
        out, (c, n, m) = layer(sequence[None])
    return out[0], {"c": c[0], "n": n[0], "m": m[0, :, 0]}


@pytest.fixture(scope="module", params=["single", "fused"])
def layer_case(request):
    config = transformers.xLSTMConfig(hidden_size=32, num_heads=HEADS, chunk_size=CHUNK, weight_mode=request.param,
                                      use_bias=True)
    layer = randomize(xLSTMLayer(config), seed=1)
    sequences = make_sequences(LENGTHS, 32, seed=2)
    return layer, config, sequences, [hf_layer_run(layer, s) for s in sequences]


@pytest.mark.parametrize(
    "schedule", [whole(LENGTHS), chunked(LENGTHS, seed=3, max_chunk=7), prefill_then_decode(LENGTHS, 5)],
    ids=["whole", "chunked", "decode"],
)
def test_mlstm_kind_matches_the_hf_layer(layer_case, schedule):
    """Float64 weights: run whole, each sequence takes transformers' arithmetic; cut
    otherwise, the step's float32 state (inference_state_dtype) rounds elsewhere."""
    layer, config, sequences, references = layer_case
    outputs, states = run_schedule(MLSTM, layer, config, sequences, schedule)
    tolerance = 1e-12 if schedule == whole(LENGTHS) else 1e-5
    for i, (expected, expected_states) in enumerate(references):
        torch.testing.assert_close(outputs[i], expected, rtol=tolerance, atol=tolerance, msg=f"sequence {i} output")
        for name, value in expected_states.items():
            torch.testing.assert_close(states[i][name], value.to(states[i][name].dtype), rtol=tolerance,
                                       atol=tolerance, msg=f"sequence {i} {name}")


@pytest.mark.skipif(not mlstm_kernel_available(), reason="cpu_xlstm.c does not build here")
def test_the_native_core_matches_the_hf_layer_in_float32():
    """The kind with its step loop in C (float32 only) under chunked and decode schedules."""
    config = transformers.xLSTMConfig(hidden_size=32, num_heads=HEADS, chunk_size=CHUNK)
    layer = randomize(xLSTMLayer(config), seed=4).float()
    sequences = [s.float() for s in make_sequences(LENGTHS, 32, seed=5)]
    references = [hf_layer_run(layer, s) for s in sequences]
    assert_native_core_matches(MlstmLayerKind(native_core=True), layer, config, sequences, references, decode_after=5)


@pytest.fixture(scope="module", params=["float32", pytest.param("float64", marks=pytest.mark.slow)])
def xlstm_model(request, tmp_path_factory) -> TinyModelCase:
    return tiny_model_case(tmp_path_factory, "xlstm", TINY, request.param)


@pytest.mark.parametrize("recurrent_kernel", ["on", pytest.param("off", marks=pytest.mark.slow)])
def test_chunked_and_forked_requests_match_transformers(xlstm_model, recurrent_kernel, monkeypatch):
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", f"recurrent_kernel={recurrent_kernel}")
    llm = assert_chunked_and_forked_requests_match(xlstm_model)
    # A model without attention layers takes the recurrent kernels' path alone (float32 runs it through C).
    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine)
    kinds = [module.kind for module in engine.runner.model.modules() if isinstance(module, RecurrentLayer)]
    assert len(kinds) == TINY["num_hidden_layers"]
    assert {kind.native_core for kind in kinds} == {recurrent_kernel == "on" and mlstm_kernel_available()}


@pytest.mark.parametrize("prefix_caching", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["prefix-caching", "no-prefix-caching"])
def test_template_rows_match_transformers(xlstm_model, prefix_caching):
    assert_template_rows_match(xlstm_model, prefix_caching, max_num_batched_tokens=32)


@pytest.mark.slow
def test_a_step_longer_than_max_inference_chunksize_runs_whole(tmp_path):
    """transformers splits an input longer than max_inference_chunksize into pieces it
    runs in turn; the engine's packed step reaches its layers whole (the split is a
    memory bound, not part of the math), with transformers' tokens."""
    model_dir = str(build_tiny_model(tmp_path, "xlstm", **{**TINY, "max_inference_chunksize": 8}))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(3, (10, 30), 500, seed=7)
    expected = [hf_greedy(hf_model, prompt, 4) for prompt in prompts]
    llm = LLM(model_dir, dtype="float32", max_model_len=64, max_num_batched_tokens=64)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=4),
                           use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
