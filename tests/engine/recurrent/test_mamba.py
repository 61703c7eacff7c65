"""The Mamba-1 kind against each Hugging Face Mamba-1 mixer (float64, random weights):
sequences of several lengths packed in one call, cut into chunks across calls, and
decoded token by token give the module's output on each sequence alone, and its
final conv window and SSM state."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from shardline.engine.recurrent.mamba import MAMBA
from shardline.engine.recurrent.selective_scan import selective_scan_varlen, selective_state_update

from .mixer_parity import (
    assert_matches_references,
    chunked,
    hf_reference,
    make_sequences,
    prefill_then_decode,
    randomize,
    run_schedule,
    whole,
)

LENGTHS = [9, 1, 40, 3, 6]
HIDDEN = 16
# intermediate 32, state 8, dt rank 4, conv 4
CONFIGS = {
    "mamba": lambda: transformers.MambaConfig(
        hidden_size=HIDDEN, intermediate_size=32, state_size=8, time_step_rank=4, conv_kernel=4, num_hidden_layers=1,
    ),
    "falcon_mamba": lambda: transformers.FalconMambaConfig(
        hidden_size=HIDDEN, intermediate_size=32, state_size=8, time_step_rank=4, conv_kernel=4, num_hidden_layers=1,
    ),
    "jamba": lambda: transformers.JambaConfig(
        hidden_size=HIDDEN, mamba_expand=2, mamba_d_state=8, mamba_dt_rank=4, mamba_d_conv=4, num_hidden_layers=1,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
    ),
    "zamba": lambda: transformers.ZambaConfig(
        hidden_size=HIDDEN, mamba_expand=2, mamba_d_state=8, mamba_dt_rank=4, mamba_d_conv=4, n_mamba_heads=2,
        num_hidden_layers=3,  # layers 0 and 1 are mamba layers
    ),
}
MIXERS = {
    "mamba": "MambaMixer",
    "falcon_mamba": "FalconMambaMixer",
    "jamba": "JambaMambaMixer",
    "zamba": "ZambaMambaMixer",
}


def build_mixer(name: str, seed: int = 0):
    config = CONFIGS[name]()
    modeling = getattr(getattr(transformers.models, name), f"modeling_{name}")
    mixer_class = getattr(modeling, MIXERS[name])
    # FalconMambaMixer's own init reads its norms before creating them; weights are random anyway.
    extra = {"initialize_mixer_weights": False} if name in ("mamba", "falcon_mamba") else {}
    mixer = mixer_class(config, layer_idx=0, **extra)
    mixer = randomize(mixer, seed)
    with torch.no_grad():  # decays of several sizes: A = -exp(A_log)
        mixer.A_log.copy_(torch.log(torch.linspace(0.2, 3.0, mixer.A_log.numel(), dtype=torch.float64)).reshape(
            mixer.A_log.shape))
    return mixer, config


def hf_states(cache, layer_idx: int = 0) -> dict[str, torch.Tensor]:
    """The HF cache's conv window [C, K] and SSM state, in the kind's layout."""
    layer = cache.layers[layer_idx]
    return {"conv": layer.conv_states[0][0, :, 1:].t(), "ssm": layer.recurrent_states[0][0].reshape(-1, 8)}


@functools.cache
def mixer_case(name: str):
    """The mixer, its sequences and the HF module's output and cache on each alone."""
    mixer, config = build_mixer(name)
    sequences = make_sequences(LENGTHS, HIDDEN, seed=1)
    references = [hf_reference(mixer, config, s, layer_idx=0) for s in sequences]
    return mixer, config, sequences, references


SCHEDULES = {"whole": whole(LENGTHS), "chunked": chunked(LENGTHS, seed=2, max_chunk=37),
             "decode": prefill_then_decode(LENGTHS, 4)}
# Every schedule for mamba; the chunked one (packed, continued, single-token chunks
# mixed) for the other mixers by default, the rest slow-marked.
CASES = [
    pytest.param(name, schedule, id=f"{name}-{schedule}",
                 marks=() if name == "mamba" or schedule == "chunked" else pytest.mark.slow)
    for name in CONFIGS for schedule in SCHEDULES
]


@pytest.mark.parametrize("name", ["mamba", "zamba"])
def test_mamba_kind_through_the_cpu_kernels_matches_the_hf_mixer(name):
    """A float32 mixer with its convolution and decode updates through the CPU kernels
    (kernels/cpu_recurrent.py), which the kind takes there: prefill then decode gives
    the HF mixer's outputs and states within float32 rounding (zamba: grouped B and C,
    a gate of every other projected column)."""
    from shardline.engine.kernels.cpu_recurrent import decode_kernel_available
    from shardline.engine.recurrent.mamba import MambaKind

    if not decode_kernel_available(torch.float32):
        pytest.skip("the recurrent kernel cannot be built here")
    mixer, config = build_mixer(name)
    mixer = mixer.float()
    sequences = [s.float() for s in make_sequences(LENGTHS, HIDDEN, seed=1)]
    outputs, states = run_schedule(MambaKind(native_core=True), mixer, config, sequences, SCHEDULES["decode"])
    references = [hf_reference(mixer, config, sequence, layer_idx=0) for sequence in sequences]
    assert_matches_references(outputs, states, references, hf_states, tolerance=1e-4)


@pytest.mark.parametrize("name,schedule", CASES)
def test_mamba_kind_matches_the_hf_mixer(name, schedule):
    mixer, config, sequences, references = mixer_case(name)
    outputs, states = run_schedule(MAMBA, mixer, config, sequences, SCHEDULES[schedule])
    # HF scans a whole sequence in float64 here; decode steps run in float32 (here and in HF).
    assert_matches_references(outputs, states, references, hf_states, tolerance=1e-5)


def test_a_whole_prefill_is_exact_in_float64():
    """No decode step (every continued chunk has 2 tokens or more): the chunked doubling
    scan equals HF's sequential float64 scan to rounding."""
    mixer, config = build_mixer("mamba", seed=4)
    sequences = make_sequences(LENGTHS, HIDDEN, seed=5)
    split = [[(i, n if n < 4 else n - n // 2) for i, n in enumerate(LENGTHS)],
             [(i, n // 2) for i, n in enumerate(LENGTHS) if n >= 4]]
    outputs, states = run_schedule(MAMBA, mixer, config, sequences, split)
    for i, sequence in enumerate(sequences):
        expected, cache = hf_reference(mixer, config, sequence, layer_idx=0)
        torch.testing.assert_close(outputs[i], expected, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(states[i]["ssm"], hf_states(cache)["ssm"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_selective_scan_matches_the_recurrence_from_saved_states(chunk_size):
    gen = torch.Generator().manual_seed(3)
    lengths, has_state = [5, 1, 11, 2], [True, False, True, False]
    channels, groups, state_size = 6, 2, 4
    total = sum(lengths)
    # x and B float32-representable: the scan reads them in float32, as HF's does.
    x, z = (torch.randn(total, channels, generator=gen).double() for _ in range(2))
    dt = torch.rand(total, channels, generator=gen, dtype=torch.float64)
    A = -torch.rand(channels, state_size, generator=gen, dtype=torch.float64) * 2
    B, C = (torch.randn(total, groups, state_size, generator=gen).double() for _ in range(2))
    D = torch.randn(channels, generator=gen, dtype=torch.float64)
    saved = torch.randn(len(lengths), channels, state_size, generator=gen, dtype=torch.float64)
    initial = saved * torch.tensor(has_state, dtype=torch.float64)[:, None, None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    y, final = selective_scan_varlen(x, dt, A, B, C, D, z, cu, initial, chunk_size=chunk_size)
    per_group = channels // groups
    for b in range(len(lengths)):
        state = initial[b]
        for t in range(int(cu[b]), int(cu[b + 1])):
            Bt, Ct = B[t].repeat_interleave(per_group, 0), C[t].repeat_interleave(per_group, 0)
            state = torch.exp(dt[t][:, None] * A) * state + dt[t][:, None] * Bt * x[t][:, None]
            expected = ((state * Ct).sum(-1) + D * x[t]) * torch.nn.functional.silu(z[t])
            torch.testing.assert_close(y[t], expected, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final[b], state, rtol=1e-10, atol=1e-10)
    # One float32 update from the final states continues the same recurrence.
    last = cu[1:] - 1
    next_state = final.clone()
    step = selective_state_update(next_state, x[last], dt[last], A, B[last], C[last], D, z[last])
    B_last = B[last].repeat_interleave(per_group, 1)
    expected_state = torch.exp(dt[last][..., None] * A) * final + dt[last][..., None] * B_last * x[last][..., None]
    torch.testing.assert_close(next_state, expected_state, rtol=1e-5, atol=1e-5)
    assert step.shape == x[last].shape
