"""Each recurrent kind with its Triton kernels against its Hugging Face module in
float32, over a chunked schedule (packed, continued, single-token continuations beside
chunks) and a prefill-then-decode one, so the kernels see the layouts the kinds really
hand them (values sliced from the q|k|v rows, decays per head or per key channel,
grouped B and C). On CUDA the kinds' own dispatch takes the kernels (the test counts
the launches it makes); on CPU, where the dispatch keeps to torch, the names each kind
calls are pointed at the launchers that dispatch takes, interpreted. The gated
delta-net's chunked schedule runs by default, the rest are slow-marked."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardline.engine.kernels._triton import triton_available
from shardline.engine.kernels.delta_rule import chunk_gated_delta_rule_triton
from shardline.engine.kernels.delta_rule_step import delta_rule_step_triton
from shardline.engine.kernels.kda import chunk_kda_triton
from shardline.engine.kernels.selective_scan import ssd_decode_packed
from shardline.engine.kernels.ssd_scan import ssd_chunk_scan_triton
from shardline.engine.recurrent import delta_rule, gated_delta_net, kda, linear_attention, mamba2, ssd

from ..recurrent.mixer_parity import UNSET, chunked, hf_reference, make_sequences, prefill_then_decode, randomize
from .conftest import DEVICE

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

HIDDEN = 32
LENGTHS = [9, 1, 40, 3, 20]
SCHEDULES = {"chunked": chunked(LENGTHS, seed=2, max_chunk=19), "decode": prefill_then_decode(LENGTHS, 4)}
_GDN = dict(hidden_size=HIDDEN, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"])


def _qwen3_5():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = transformers.Qwen3_5TextConfig(**_GDN)
    return Qwen3_5GatedDeltaNet(config, 0), config, gated_delta_net.GATED_DELTA_NET


def _mamba2():
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    config = transformers.Mamba2Config(hidden_size=HIDDEN, num_heads=4, head_dim=16, expand=2, state_size=16,
                                       n_groups=2, chunk_size=4, conv_kernel=4, num_hidden_layers=1)
    return Mamba2Mixer(config, 0), config, mamba2.MAMBA2


def _kimi_linear():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    config = transformers.KimiLinearConfig(hidden_size=HIDDEN, linear_num_heads=2, linear_head_dim=16,
                                           linear_conv_kernel_dim=4, num_hidden_layers=2,
                                           layer_types=["linear_attention", "full_attention"])
    return KimiLinearDeltaAttention(config, layer_idx=0), config, kda.KIMI_DELTA


def _minimax():
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    config = transformers.MiniMaxConfig(hidden_size=HIDDEN, num_attention_heads=2, head_dim=16, num_hidden_layers=3,
                                        block_size=16,
                                        layer_types=["linear_attention", "linear_attention", "full_attention"])
    return MiniMaxLightningAttention(config, layer_idx=1), config, linear_attention.LIGHTNING


MODELS = {"qwen3_5": _qwen3_5, "mamba2": _mamba2, "kimi_linear": _kimi_linear, "minimax": _minimax}


def counted(launches: dict[str, int], name: str, launch):
    def run(*args, **kwargs):
        launches[name] = launches.get(name, 0) + 1
        return launch(*args, **kwargs)
    return run


def count_dispatched_launches(monkeypatch) -> dict[str, int]:
    """CUDA: wrap the launchers the kinds' dispatch calls, to count its launches."""
    launches: dict[str, int] = {}
    for module, name, kind in [(delta_rule, "chunk_gated_delta_rule_triton", "chunk"),
                               (delta_rule, "delta_rule_step_triton", "step"), (kda, "chunk_kda_triton", "chunk"),
                               (kda, "delta_rule_step_triton", "step"), (ssd, "ssd_chunk_scan_triton", "chunk"),
                               (mamba2, "ssd_decode_packed", "step"), (linear_attention, "ssd_decode_packed", "step")]:
        monkeypatch.setattr(module, name, counted(launches, kind, getattr(module, name)))
    return launches


def route_to_kernels(monkeypatch) -> dict[str, int]:
    """CPU: point the scans the kinds call at the Triton launchers; returns launch counts."""
    launches: dict[str, int] = {}

    def gdn_chunk(q, k, v, g, beta, cu_seqlens, initial_state):
        if q.shape[0] == cu_seqlens.shape[0] - 1:  # as the torch rule: one token each takes the step
            return delta_rule_step_triton(q, k, v, g, beta, initial_state), initial_state
        return chunk_gated_delta_rule_triton(q, k, v, g, beta, cu_seqlens, initial_state)

    def ssd_chunk(x, dt, A, B, C, D, chunk_size, cu_seqlens, initial_state, compute_dtype=torch.float32):
        assert compute_dtype == torch.float32
        return ssd_chunk_scan_triton(x, dt, A, B, C, D, cu_seqlens, initial_state)

    def ssd_step(state, x, dt, A, B, C, D, decay_dtype=torch.float32):
        return ssd_decode_packed(state, x, dt, A, B, C, D)

    monkeypatch.setattr(gated_delta_net, "chunk_gated_delta_rule_varlen", counted(launches, "chunk", gdn_chunk))
    monkeypatch.setattr(gated_delta_net, "gated_delta_rule_step", counted(
        launches, "step", lambda q, k, v, g, beta, state: (delta_rule_step_triton(q, k, v, g, beta, state), state)))
    for module in (mamba2, linear_attention):
        monkeypatch.setattr(module, "ssd_chunk_scan_varlen", counted(launches, "chunk", ssd_chunk))
        monkeypatch.setattr(module, "ssd_decode_step", counted(launches, "step", ssd_step))
    monkeypatch.setattr(kda, "chunk_kda_varlen", counted(
        launches, "chunk", lambda q, k, v, g, beta, cu_seqlens, initial_state: chunk_kda_triton(
            q, k, v, g, beta, cu_seqlens, initial_state)))
    monkeypatch.setattr(kda, "kda_decode_step", counted(
        launches, "step", lambda state, q, k, v, g, beta: delta_rule_step_triton(q, k, v, g, beta, state)))
    return launches


def run_schedule_on(device, kind, module, config, sequences, schedule) -> list[torch.Tensor]:
    """mixer_parity.run_schedule with every tensor on ``device``: each sequence's output."""
    shapes = kind.state_shapes(module, config)
    states = [{name: torch.full(shape, UNSET, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()}
              for _ in sequences]
    consumed = [0] * len(sequences)
    outputs: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in schedule:
        chunks = [sequences[i][consumed[i] : consumed[i] + n] for i, n in step]
        cu_seqlens = torch.tensor([0] + [n for _, n in step], device=device).cumsum(0)
        has_initial_state = torch.tensor([consumed[i] > 0 for i, _ in step], device=device)
        gathered = {name: torch.stack([states[i][name] for i, _ in step]) for name in shapes}
        with torch.no_grad():
            out = kind.forward(module, torch.cat(chunks), cu_seqlens, has_initial_state, gathered)
        for b, (i, n) in enumerate(step):
            outputs[i].append(out[cu_seqlens[b] : cu_seqlens[b + 1]])
            for name in shapes:
                states[i][name] = gathered[name][b].clone()
            consumed[i] += n
    return [torch.cat(o) for o in outputs]


def hf_outputs(name, layer, config, sequences):
    if name == "minimax":  # its forward takes no cache: (output, state)
        with torch.no_grad():
            return [layer(s[None], position_embeddings=None, attention_mask=None)[0][0] for s in sequences]
    return [hf_reference(layer, config, s, layer_idx=0)[0] for s in sequences]


CASES = [pytest.param(name, schedule, id=f"{name}-{schedule}",
                      marks=() if (name, schedule) == ("qwen3_5", "chunked") else pytest.mark.slow)
         for name in MODELS for schedule in SCHEDULES]


@pytest.mark.parametrize("name,schedule", CASES)
def test_kind_on_its_triton_kernels_matches_the_hf_module(name, schedule, monkeypatch):
    module, config, kind = MODELS[name]()
    layer = randomize(module, seed=0).float().to(DEVICE)
    sequences = [s.float().to(DEVICE) for s in make_sequences(LENGTHS, HIDDEN, seed=1)]
    expected = hf_outputs(name, layer, config, sequences)
    launches = count_dispatched_launches(monkeypatch) if DEVICE == "cuda" else route_to_kernels(monkeypatch)
    outputs = run_schedule_on(DEVICE, kind, layer, config, sequences, SCHEDULES[schedule])
    assert launches.get("chunk", 0) > 0 and launches.get("step", 0) > 0, launches
    for i, (output, reference) in enumerate(zip(outputs, expected)):
        torch.testing.assert_close(output, reference, rtol=1e-4, atol=1e-4, msg=f"sequence {i}")
