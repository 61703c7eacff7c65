"""The recurrent core's CPU kernel (kernels/cpu_recurrent.c) against its plain-torch
reference, built for each kernel target, with one decay per head (gated delta-net) or
per key channel (Kimi delta attention), and the convolution alone against its
reference; the engine takes them on a hybrid model, and gives transformers' greedy
tokens with them and with them turned off."""

from __future__ import annotations

import shutil

import pytest
import torch

from shardline.engine.kernels import cpu_recurrent, native
from shardline.engine.kernels.cpu_recurrent import causal_conv1d, delta_rule_core, recurrent_kernel_available
from shardline.engine.kernels.recurrent_reference import causal_conv1d_reference, delta_rule_core_reference

pytestmark = pytest.mark.skipif(cpu_recurrent.load_library() is None, reason="no C compiler to build the kernel")

CROSS_COMPILER = shutil.which("aarch64-linux-gnu-gcc")


def make_step(lengths: list[int], initial: list[bool], num_key_heads: int, num_heads: int, key_dim: int,
              value_dim: int, dtype: torch.dtype, width: int = 4, bias: bool = True, g_per_key: bool = False,
              seed: int = 0) -> dict:
    """A packed step's projected q|k|v rows and states; the states of requests that start
    fresh hold NaN, so a read of them shows in every output."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)

    channels = 2 * num_key_heads * key_dim + num_heads * value_dim
    num_tokens, num_requests = sum(lengths), len(lengths)
    fresh = ~torch.tensor(initial)
    conv_state = randn(num_requests, width - 1, channels)
    state = randn(num_requests, num_heads, key_dim, value_dim, scale=0.1)
    conv_state[fresh] = float("nan")
    state[fresh] = float("nan")
    return dict(
        mixed_qkv=randn(num_tokens, channels), conv_weight=randn(channels, width, scale=0.5),
        conv_bias=randn(channels) if bias else None,
        g=-torch.rand(num_tokens, num_heads, *([key_dim] if g_per_key else []), generator=generator,
                      dtype=torch.float64).to(dtype),
        beta=torch.rand(num_tokens, num_heads, generator=generator, dtype=torch.float64).to(dtype),
        cu_seqlens=torch.tensor([0, *lengths]).cumsum(0), has_initial_state=torch.tensor(initial),
        conv_state=conv_state, state=state, num_key_heads=num_key_heads)


# (lengths, whether each continues a saved state): prefill chunks beside decode tokens;
# a decode step; prompts shorter than the convolution window.
STEPS = {
    "mixed": ([5, 1, 37, 2, 1], [True, True, False, True, False]),
    "decode": ([1] * 6, [True] * 6),
    "short": ([2, 1, 3], [False, True, True]),
}
# (Hk, H, K, V): the benchmark's heads (the kernel's sizes compiled as constants), others,
# and Kimi delta attention's (as many key heads as value heads, a decay per key channel).
HEADS = [(2, 4, 64, 64), (1, 2, 16, 24), (2, 2, 128, 128), (2, 2, 64, 64, "per key")]
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-12}


# float64 every step and head size; float32 the benchmark's heads on every step, the others on the mixed one.
CASES = [pytest.param(step, heads, dtype, id=f"{step}-{'x'.join(map(str, heads)).replace(' ', '-')}-{dtype}")
         for dtype in (torch.float32, torch.float64) for heads in HEADS for step in sorted(STEPS)
         if dtype == torch.float64 or heads == HEADS[0] or step == "mixed"]


@pytest.mark.parametrize("step,heads,dtype", CASES)
def test_kernel_matches_the_reference(kernel_target, step, heads, dtype):
    lengths, initial = STEPS[step]
    num_key_heads, num_heads, key_dim, value_dim = heads[:4]
    args = make_step(lengths, initial, num_key_heads, num_heads, key_dim, value_dim, dtype,
                     bias=step != "decode", g_per_key=len(heads) > 4)
    expected = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in args.items()}
    out = delta_rule_core(**args)
    want = delta_rule_core_reference(**expected)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out, want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(args["state"], expected["state"], rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(args["conv_state"], expected["conv_state"], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_convolution_matches_the_reference(kernel_target, step, activation, dtype):
    """The convolution alone, over more channels than one task takes (300 = 256 + 44),
    its inputs rows of a wider tensor (as a projection's split leaves them)."""
    lengths, initial = STEPS[step]
    generator = torch.Generator().manual_seed(4)
    channels, width = 300, 3
    x = torch.randn(sum(lengths), 2 * channels, generator=generator, dtype=torch.float64).to(dtype)[:, :channels]
    weight, bias = (torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)
                    for shape in ((channels, width), (channels,)))
    conv_state = torch.randn(len(lengths), width - 1, channels, generator=generator, dtype=torch.float64).to(dtype)
    conv_state[~torch.tensor(initial)] = float("nan")
    saved = conv_state.clone()
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    out = causal_conv1d(x, weight, bias, cu_seqlens, torch.tensor(initial), conv_state, activation)
    tolerance = TOLERANCE[dtype]
    for b, start in enumerate(cu_seqlens[:-1].tolist()):
        rows = slice(start, start + lengths[b])
        want, window = causal_conv1d_reference(x[rows], weight, bias, saved[b] if initial[b] else None, activation)
        torch.testing.assert_close(out[rows], want, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(conv_state[b], window, rtol=0, atol=0)


@pytest.mark.parametrize("with_d", [True, False])
def test_ssd_decode_matches_the_reference(kernel_target, with_d):
    """A Mamba-2 mixer's decode tokens: x, B and C views of the convolution's rows."""
    from shardline.engine.kernels.cpu_recurrent import ssd_decode_step
    from shardline.engine.recurrent.ssd import ssd_decode_step as reference

    requests, heads, groups, head_dim, state_size = 5, 8, 2, 16, 32
    generator = torch.Generator().manual_seed(6)
    rows = torch.randn(requests, heads * head_dim + 2 * groups * state_size + 3, generator=generator)
    x = rows[:, : heads * head_dim].reshape(requests, heads, head_dim)
    B, C = (rows[:, heads * head_dim + i * groups * state_size:][:, : groups * state_size]
            .reshape(requests, groups, state_size) for i in range(2))
    dt, A = torch.rand(requests, heads, generator=generator), -torch.rand(heads, generator=generator)
    D = torch.randn(heads, generator=generator) if with_d else None
    state = torch.randn(requests, heads, head_dim, state_size, generator=generator)
    expected_state = state.clone()
    y = ssd_decode_step(state, x, dt, A, B, C, D)
    torch.testing.assert_close(y, reference(expected_state, x, dt, A, B, C, D), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state, expected_state, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("groups,gated", [(1, True), (2, False)])
def test_selective_decode_matches_the_reference(kernel_target, groups, gated):
    """A Mamba mixer's decode tokens over more channels than one task takes (300):
    x and the gate views of the projection's rows, B and C of another's."""
    from shardline.engine.kernels.cpu_recurrent import selective_state_update
    from shardline.engine.recurrent.selective_scan import selective_state_update as reference

    requests, channels, state_size = 4, 300, 16
    generator = torch.Generator().manual_seed(8)
    projected = torch.randn(requests, 2 * channels + 1, generator=generator)
    x, z = projected[:, :channels], projected[:, channels : 2 * channels] if gated else None
    rows = torch.randn(requests, 2 * groups * state_size + 3, generator=generator)
    B, C = (rows[:, i * groups * state_size :][:, : groups * state_size].reshape(requests, groups, state_size)
            for i in range(2))
    dt = torch.rand(requests, channels, generator=generator)
    A, D = -torch.rand(channels, state_size, generator=generator), torch.randn(channels, generator=generator)
    state = torch.randn(requests, channels, state_size, generator=generator)
    expected_state = state.clone()
    y = selective_state_update(state, x, dt, A, B, C, D, z)
    torch.testing.assert_close(y, reference(expected_state, x, dt, A, B, C, D, z), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state, expected_state, rtol=2e-5, atol=2e-5)


def test_threads_give_the_same_result():
    """(request, head) pairs split over threads: the same bits as on one thread."""
    args = make_step([40, 1, 1, 23], [False, True, True, True], 2, 4, 64, 64, torch.float32)
    copy = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in args.items()}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = delta_rule_core(**args)
        torch.set_num_threads(max(2, threads))
        several = delta_rule_core(**copy)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, several) and torch.equal(args["state"], copy["state"])


def test_availability_follows_dtype_and_head_size():
    assert recurrent_kernel_available(torch.float32, 64, 64) and recurrent_kernel_available(torch.float64, 128, 256)
    assert not recurrent_kernel_available(torch.bfloat16, 64, 64)
    assert not recurrent_kernel_available(torch.float32, 64, cpu_recurrent.MAX_HEAD_DIM + 1)


@pytest.mark.skipif(CROSS_COMPILER is None, reason="no aarch64 cross compiler (apt install gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("target", ["armv8-a", "armv8.2-a+bf16"])
def test_kernel_builds_for_arm(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))
    library = native._build(cpu_recurrent.SOURCE, CROSS_COMPILER, target)
    assert library.read_bytes()[:4] == b"\x7fELF" and library.read_bytes()[18] == 183  # e_machine: AArch64


_HYBRID = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, num_hidden_layers=3,
               layer_types=["linear_attention", "full_attention", "linear_attention"])


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    """A tiny qwen3_5_text model (two gated delta-net layers), prompts and transformers'
    float32 greedy tokens."""
    import transformers

    from shardline.engine.model.tiny import build_tiny_model

    from ..hf_reference import hf_greedy, random_prompts

    model_dir = str(build_tiny_model(tmp_path_factory.mktemp("qwen3_5_text"), "qwen3_5_text", **_HYBRID))
    prompts = random_prompts(4, (3, 40), 500, seed=5)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    expected = [hf_greedy(hf_model, prompt, 6) for prompt in prompts]
    return model_dir, prompts, expected


@pytest.mark.parametrize("kernel", ["on", "off"])
def test_engine_with_and_without_the_kernel_gives_transformers_tokens(hybrid_model, monkeypatch, kernel):
    """The engine takes the kernel for its gated delta-net layers unless turned off
    (SHARDLINE_CPU_PATHS=recurrent_kernel=off); chunked prefill (a 16-token budget)
    and decode give transformers' greedy tokens either way. (The hybrid parity tests
    run float64 models with the kernel, as the engine takes it by default.)"""
    from shardline import LLM, SamplingParams
    from shardline.engine.recurrent.state import RecurrentLayer

    model_dir, prompts, expected = hybrid_model
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", f"recurrent_kernel={kernel}")
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4)
    layers = [m for m in llm.llm_engine.model.modules() if isinstance(m, RecurrentLayer)]
    assert llm.llm_engine.cpu_paths.recurrent_kernel == (kernel == "on")
    assert len(layers) == 2 and all(layer.kind.native_core == (kernel == "on") for layer in layers)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    llm.close()
