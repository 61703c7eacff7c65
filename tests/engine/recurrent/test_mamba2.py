"""The Mamba-2 kind against each Hugging Face Mamba-2 mixer (float64, random weights):
sequences of several lengths packed in one call, cut into chunks across calls, and
decoded token by token give the module's output on each sequence alone, and its
final conv window and SSM state."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from shardline.engine.recurrent.mamba2 import MAMBA2
from shardline.engine.recurrent.ssd import ssd_chunk_scan_varlen, ssd_decode_step

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

LENGTHS = [9, 1, 14, 3, 6]
HIDDEN = 16
# heads 4 x head_dim 8 (intermediate 32), state 8, 2 groups, chunk 4, conv 4.
CONFIGS = {
    "mamba2": lambda: transformers.Mamba2Config(
        hidden_size=HIDDEN, num_heads=4, head_dim=8, expand=2, state_size=8, n_groups=2, chunk_size=4,
        conv_kernel=4, num_hidden_layers=1,
    ),
    "nemotron_h": lambda: transformers.NemotronHConfig(
        hidden_size=HIDDEN, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=4,
        conv_kernel=4, layers_block_type=["mamba"], num_hidden_layers=1,
    ),
    "bamba": lambda: transformers.BambaConfig(
        hidden_size=HIDDEN, mamba_n_heads=4, mamba_d_head=8, mamba_expand=2, mamba_d_state=8, mamba_n_groups=2,
        mamba_chunk_size=4, mamba_d_conv=4, num_hidden_layers=1, attn_layer_indices=[],
    ),
    "zamba2": lambda: transformers.Zamba2Config(
        hidden_size=HIDDEN, n_mamba_heads=4, mamba_headdim=8, mamba_expand=2, mamba_d_state=8, mamba_ngroups=2,
        chunk_size=4, mamba_d_conv=4, num_hidden_layers=1, layers_block_type=["mamba"],
    ),
    "falcon_h1": lambda: transformers.FalconH1Config(
        hidden_size=HIDDEN, mamba_n_heads=4, mamba_d_head=8, mamba_expand=2, mamba_d_state=8, mamba_n_groups=2,
        mamba_chunk_size=4, mamba_d_conv=4, num_hidden_layers=1, mamba_d_ssm=32, ssm_in_multiplier=0.7,
        ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.6],
    ),
    "falcon_h1_no_norm": lambda: transformers.FalconH1Config(
        hidden_size=HIDDEN, mamba_n_heads=4, mamba_d_head=8, mamba_expand=2, mamba_d_state=8, mamba_n_groups=2,
        mamba_chunk_size=4, mamba_d_conv=4, num_hidden_layers=1, mamba_d_ssm=32, mamba_rms_norm=False,
    ),
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        hidden_size=HIDDEN, mamba_n_heads=4, mamba_d_head=8, mamba_expand=2, mamba_d_state=8, mamba_n_groups=2,
        mamba_chunk_size=4, mamba_d_conv=4, num_hidden_layers=1, layer_types=["mamba"],
    ),
}
MIXERS = {
    "mamba2": ("mamba2", "Mamba2Mixer"),
    "nemotron_h": ("nemotron_h", "NemotronHMamba2Mixer"),
    "bamba": ("bamba", "BambaMixer"),
    "zamba2": ("zamba2", "Zamba2MambaMixer"),
    "falcon_h1": ("falcon_h1", "FalconH1Mixer"),
    "falcon_h1_no_norm": ("falcon_h1", "FalconH1Mixer"),
    "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridMambaLayer"),
}


def build_mixer(name: str, seed: int = 0):
    config = CONFIGS[name]()
    module_name, class_name = MIXERS[name]
    modeling = getattr(transformers.models, module_name)
    mixer_class = getattr(getattr(modeling, f"modeling_{module_name}"), class_name)
    mixer = randomize(mixer_class(config, layer_idx=0), seed)
    if module_name == "falcon_h1":  # FalconH1Model gives each mixer its mup vector
        mup = modeling.modeling_falcon_h1.compute_mup_vector(config)
        mixer.register_buffer("mup_vector", mup.double(), persistent=False)
    return mixer, config


def hf_states(cache, layer_idx: int = 0) -> dict[str, torch.Tensor]:
    """The HF cache's conv window [C, K] and SSM state, in the kind's layout."""
    layer = cache.layers[layer_idx]
    return {"conv": layer.conv_states[0][0, :, 1:].t(), "ssm": layer.recurrent_states[0][0]}


@functools.cache
def mixer_case(name: str):
    """The mixer, its sequences and the HF module's output and cache on each alone."""
    mixer, config = build_mixer(name)
    sequences = make_sequences(LENGTHS, HIDDEN, seed=1)
    references = [hf_reference(mixer, config, s, layer_idx=0) for s in sequences]
    return mixer, config, sequences, references


SCHEDULES = {"whole": whole(LENGTHS), "chunked": chunked(LENGTHS, seed=2), "decode": prefill_then_decode(LENGTHS, 4)}
# Every schedule for mamba2; the chunked one (packed, continued, single-token chunks
# mixed) for the other mixers by default, the rest slow-marked.
CASES = [
    pytest.param(name, schedule, id=f"{name}-{schedule}",
                 marks=() if name == "mamba2" or schedule == "chunked" else pytest.mark.slow)
    for name in CONFIGS for schedule in SCHEDULES
]


@pytest.mark.parametrize("name", ["mamba2", "nemotron_h"])
def test_mamba2_kind_through_the_cpu_kernels_matches_the_hf_mixer(name):
    """A float32 mixer with its convolution and decode updates through the CPU kernels
    (kernels/cpu_recurrent.py), which the kind takes there: prefill then decode gives
    the HF mixer's outputs and states within float32 rounding."""
    from shardline.engine.kernels.cpu_recurrent import decode_kernel_available
    from shardline.engine.recurrent.mamba2 import Mamba2Kind

    if not decode_kernel_available(torch.float32):
        pytest.skip("the recurrent kernel cannot be built here")
    mixer, config = build_mixer(name)
    mixer = mixer.float()
    sequences = [s.float() for s in make_sequences(LENGTHS, HIDDEN, seed=1)]
    outputs, states = run_schedule(Mamba2Kind(native_core=True), mixer, config, sequences, SCHEDULES["decode"])
    references = [hf_reference(mixer, config, sequence, layer_idx=0) for sequence in sequences]
    assert_matches_references(outputs, states, references, hf_states, tolerance=1e-4)


@pytest.mark.parametrize("name,schedule", CASES)
def test_mamba2_kind_matches_the_hf_mixer(name, schedule):
    mixer, config, sequences, references = mixer_case(name)
    outputs, states = run_schedule(MAMBA2, mixer, config, sequences, SCHEDULES[schedule])
    # The HF path scans in float32 (as this kind does); chunk boundaries change rounding only.
    assert_matches_references(outputs, states, references, hf_states, tolerance=1e-5)


def test_time_step_limit_clamps_chunks_but_not_decode_steps_as_the_hf_mixer_does():
    """HF clamps dt to time_step_limit in its chunked scan only; generate's decode steps
    are unclamped. The kind follows it: compared with HF's prefill-then-decode."""
    config = CONFIGS["mamba2"]()
    config.time_step_limit = (0.3, 0.9)
    mixer = randomize(transformers.models.mamba2.modeling_mamba2.Mamba2Mixer(config, layer_idx=0), seed=5)
    sequences = make_sequences(LENGTHS, HIDDEN, seed=6)
    outputs, _ = run_schedule(MAMBA2, mixer, config, sequences, prefill_then_decode(LENGTHS, 4))
    for i, sequence in enumerate(sequences):
        cache = transformers.DynamicCache(config=config)
        with torch.no_grad():
            parts = [mixer(sequence[None, :4], cache=cache)[0]]
            parts += [mixer(sequence[None, t : t + 1], cache=cache)[0] for t in range(4, len(sequence))]
        torch.testing.assert_close(outputs[i], torch.cat(parts), rtol=1e-5, atol=1e-5, msg=f"sequence {i}")
    whole_outputs, _ = run_schedule(MAMBA2, mixer, config, sequences, whole(LENGTHS))
    assert not torch.allclose(whole_outputs[0], outputs[0], rtol=1e-5, atol=1e-5), "the limit changed nothing"


@pytest.mark.parametrize("prompt_len", [4, 9])
def test_time_step_limit_follows_generate_by_position_under_any_chunking(prompt_len):
    """Told which tokens are prompt tokens (as the runner tells it), the kind clamps dt
    at those and not at generated ones, whatever the chunks: a prompt's last token alone
    in a step and generated tokens recomputed in a chunk give generate's outputs."""
    config = CONFIGS["mamba2"]()
    config.time_step_limit = (0.3, 0.9)
    mixer = randomize(transformers.models.mamba2.modeling_mamba2.Mamba2Mixer(config, layer_idx=0), seed=5)
    sequences = make_sequences(LENGTHS, HIDDEN, seed=6)
    expected = []
    for sequence in sequences:
        cache = transformers.DynamicCache(config=config)
        with torch.no_grad():
            parts = [mixer(sequence[None, :prompt_len], cache=cache)[0]]
            parts += [mixer(sequence[None, t : t + 1], cache=cache)[0] for t in range(prompt_len, len(sequence))]
        expected.append(torch.cat(parts))
    for schedule in (chunked(LENGTHS, seed=2), whole(LENGTHS), prefill_then_decode(LENGTHS, prompt_len - 1)):
        outputs, _ = run_schedule(MAMBA2, mixer, config, sequences, schedule, prompt_len=prompt_len)
        for i in range(len(sequences)):
            torch.testing.assert_close(outputs[i], expected[i], rtol=1e-5, atol=1e-5, msg=f"sequence {i}")


def _ssm_reference(x, dt, A, B, C, D, state):
    """Token by token, float64: the recurrence the scan computes."""
    heads_per_group = x.shape[1] // B.shape[1]
    B = B.repeat_interleave(heads_per_group, dim=1)
    C = C.repeat_interleave(heads_per_group, dim=1)
    ys = []
    for t in range(x.shape[0]):
        state = state * torch.exp(dt[t] * A)[:, None, None] + dt[t][:, None, None] * x[t][..., None] * B[t][:, None]
        ys.append(torch.einsum("hpn,hn->hp", state, C[t]) + D[:, None] * x[t])
    return torch.stack(ys), state


@pytest.mark.parametrize("chunk_size", [1, 3, 16])
def test_ssd_scan_matches_the_recurrence_from_saved_states(chunk_size):
    gen = torch.Generator().manual_seed(3)
    lengths, has_state = [5, 1, 11, 2], [True, False, True, False]
    heads, head_dim, groups, state_size = 4, 3, 2, 5
    total = sum(lengths)
    x = torch.randn(total, heads, head_dim, generator=gen, dtype=torch.float64)
    dt = torch.rand(total, heads, generator=gen, dtype=torch.float64)
    A = -torch.rand(heads, generator=gen, dtype=torch.float64) * 2
    B, C = (torch.randn(total, groups, state_size, generator=gen, dtype=torch.float64) for _ in range(2))
    D = torch.randn(heads, generator=gen, dtype=torch.float64)
    saved = torch.randn(len(lengths), heads, head_dim, state_size, generator=gen, dtype=torch.float64)
    initial = saved * torch.tensor(has_state, dtype=torch.float64)[:, None, None, None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    y, final = ssd_chunk_scan_varlen(x, dt, A, B, C, D, chunk_size, cu, initial)
    for b in range(len(lengths)):
        s, e = cu[b], cu[b + 1]
        expected, expected_state = _ssm_reference(x[s:e], dt[s:e], A, B[s:e], C[s:e], D, initial[b])
        torch.testing.assert_close(y[s:e], expected.float().double(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[b].double(), expected_state, rtol=1e-5, atol=1e-5)
    # One decode step from the final states is the recurrence's next token.
    state = final.clone()
    step = ssd_decode_step(state, x[cu[1:] - 1], dt[cu[1:] - 1], A, B[cu[1:] - 1], C[cu[1:] - 1], D)
    for b in range(len(lengths)):
        t = int(cu[b + 1]) - 1
        expected, expected_state = _ssm_reference(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D,
                                                  final[b].double())
        torch.testing.assert_close(step[b], expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[b].double(), expected_state, rtol=1e-5, atol=1e-5)
