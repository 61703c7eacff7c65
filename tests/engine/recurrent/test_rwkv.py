"""RWKV-4 as a recurrent kind: the WKV scan against transformers' own loop, the block
kind against transformers' RwkvBlock under packed, chunked and decode schedules, and
whole tiny models giving transformers' greedy tokens (float32 and float64) with
chunked prefill, n = 2, and prefix caching over template rows (a hit continues from
the state saved at its last block). RWKV keeps no KV blocks, so nothing preempts it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.models.rwkv.modeling_rwkv import RwkvBlock, rwkv_linear_attention_cpu

from shardline.engine.kernels.cpu_rwkv import rwkv_kernel_available
from shardline.engine.kernels.rwkv_wkv import wkv_varlen
from shardline.engine.recurrent.rwkv import RWKV, RwkvBlockKind

from .attention_free import (
    TinyModelCase,
    assert_chunked_and_forked_requests_match,
    assert_native_core_matches,
    assert_template_rows_match,
    tiny_model_case,
)
from .mixer_parity import chunked, make_sequences, prefill_then_decode, randomize, run_schedule, whole

LENGTHS = [9, 1, 23, 3, 6]
HIDDEN, WIDTH, LAYERS = 16, 8, 2
# transformers' generate keeps the WKV state hidden_size wide: the models' WKV width is the hidden size.
TINY: dict[str, Any] = dict(hidden_size=64, attention_hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                            rescale_every=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_wkv_scan_matches_transformers_loop_from_saved_states(dtype):
    gen = torch.Generator().manual_seed(0)
    lengths, has_state = [5, 1, 11, 2], [True, False, True, False]
    decay, first = torch.randn(WIDTH, generator=gen, dtype=dtype), torch.randn(WIDTH, generator=gen, dtype=dtype)
    key = torch.randn(sum(lengths), WIDTH, generator=gen, dtype=dtype) * 3
    value = torch.randn(sum(lengths), WIDTH, generator=gen, dtype=dtype)
    saved = [torch.rand(len(lengths), WIDTH, generator=gen) + 0.5, torch.rand(len(lengths), WIDTH, generator=gen) + 1,
             torch.randn(len(lengths), WIDTH, generator=gen)]
    num, den, maximum = (tensor.clone() for tensor in saved)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = wkv_varlen(decay, first, key, value, cu, torch.tensor(has_state), num, den, maximum)
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        state = [tensor[b : b + 1].clone() for tensor in saved] if has_state[b] else None
        expected, final = rwkv_linear_attention_cpu(decay, first, key[None, rows], value[None, rows], state=state,
                                                    return_state=True)
        torch.testing.assert_close(out[rows], expected[0], rtol=1e-6, atol=1e-6)
        for name, got, want in zip(("num", "den", "max"), (num, den, maximum), final):
            torch.testing.assert_close(got[b], want[0].float(), rtol=1e-6, atol=1e-6, msg=f"request {b} {name}")


def hf_block_run(block: torch.nn.Module, sequence: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' block on one sequence from generate's fresh state: (output, states)."""
    shape = (1, HIDDEN, LAYERS)
    state = [torch.zeros(*shape, dtype=sequence.dtype if i <= 1 else torch.float32) for i in range(5)]
    state[4] -= 1e30
    with torch.no_grad():
        out, state, _ = block(sequence[None], state=state, use_cache=True)
    layer = block.layer_id
    return out[0], {"ffn_shift": state[0][0, :, layer], "att_shift": state[1][0, :, layer],
                    "num": state[2][0, :, layer], "den": state[3][0, :, layer],
                    "max": state[4][0, :, layer]}


@pytest.fixture(scope="module", params=[0, 1], ids=["block0", "block1"])
def block_case(request):
    config = transformers.RwkvConfig(hidden_size=HIDDEN, attention_hidden_size=HIDDEN, intermediate_size=32,
                                     num_hidden_layers=LAYERS)
    block = randomize(RwkvBlock(config, layer_id=request.param), seed=request.param)
    sequences = make_sequences(LENGTHS, HIDDEN, seed=1)
    return block, config, sequences, [hf_block_run(block, s) for s in sequences]


@pytest.mark.parametrize(
    "schedule", [whole(LENGTHS), chunked(LENGTHS, seed=2, max_chunk=7), prefill_then_decode(LENGTHS, 4)],
    ids=["whole", "chunked", "decode"],
)
def test_rwkv_kind_matches_the_hf_block(block_case, schedule):
    block, config, sequences, references = block_case
    outputs, states = run_schedule(RWKV, block, config, sequences, schedule)
    for i, (expected, expected_states) in enumerate(references):
        torch.testing.assert_close(outputs[i], expected, rtol=1e-5, atol=1e-5, msg=f"sequence {i} output")
        for name, value in expected_states.items():
            torch.testing.assert_close(states[i][name], value, rtol=1e-5, atol=1e-5, msg=f"sequence {i} {name}")


@pytest.mark.skipif(not rwkv_kernel_available(), reason="cpu_rwkv.c does not build here")
def test_the_native_core_matches_the_hf_block_in_float32():
    """The kind with its WKV scan in C (float32 only) under chunked and decode schedules."""
    config = transformers.RwkvConfig(hidden_size=HIDDEN, attention_hidden_size=HIDDEN, intermediate_size=32,
                                     num_hidden_layers=LAYERS)
    block = randomize(RwkvBlock(config, layer_id=1), seed=4).float()
    sequences = [s.float() for s in make_sequences(LENGTHS, HIDDEN, seed=5)]
    references = [hf_block_run(block, s) for s in sequences]
    assert_native_core_matches(RwkvBlockKind(native_core=True), block, config, sequences, references, decode_after=4)


@pytest.fixture(scope="module", params=["float32", pytest.param("float64", marks=pytest.mark.slow)])
def rwkv_model(request, tmp_path_factory) -> TinyModelCase:
    return tiny_model_case(tmp_path_factory, "rwkv", TINY, request.param)


def test_chunked_and_forked_requests_match_transformers(rwkv_model):
    assert_chunked_and_forked_requests_match(rwkv_model)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_template_rows_match_transformers(rwkv_model, prefix_caching):
    assert_template_rows_match(rwkv_model, prefix_caching, max_num_batched_tokens=16)
