"""The small_linear_kernel CPU path: packed linears run the row counts that race faster
on the small-batch C kernel on it, over oneDNN's own packed copy, and the engine's
greedy tokens stay transformers'. Off, every fallback test of test_cpu_paths.py runs."""

import json

import pytest
import torch
import transformers

from shardline.engine.cpu import linear_race
from shardline.engine.cpu.layers import FusedDecoderLayer
from shardline.engine.cpu.linear import (
    KERNEL_ROW_COUNTS,
    FusedGatedMLP,
    KernelPacked,
    PackedLinear,
    pack_weight,
    packed_matmul,
)
from shardline.engine.kernels.cpu_small_linear import small_linear_available

from .paths_taken import taken_unless_forced_off

pytestmark = pytest.mark.skipif(not (small_linear_available(torch.float32) and torch.backends.mkldnn.is_available()),
                                reason="needs a C compiler and oneDNN")
PROMPTS = [[5, 6, 7], list(range(3, 60)), [(7 * i) % 200 + 3 for i in range(90)]]


def _packed_weights(model: torch.nn.Module) -> list[object]:
    found = []
    for module in model.modules():
        if isinstance(module, PackedLinear):
            found.append(module.packed_weight)
        elif isinstance(module, FusedGatedMLP):
            found.append(module.packed_gate_up)
        elif isinstance(module, FusedDecoderLayer) and module.packed_qkv is not None:
            found.append(module.packed_qkv)
    return found


def _greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    from shardline import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                 do_sample=False, pad_token_id=2)
            tokens.append(out[0, len(prompt):].tolist())
    return tokens


@taken_unless_forced_off("packed_linears", "small_linear_kernel")
def test_turned_on_every_packed_linear_takes_the_kernel_and_tokens_stay(tiny_llama_dir, monkeypatch):
    from shardline import LLM

    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "packed_linears=on,small_linear_kernel=on")
    monkeypatch.setattr(linear_race, "TAKE_RATIO", 0.0)  # every raced row count taken
    expected = _hf_greedy(tiny_llama_dir, PROMPTS)
    assert expected != _hf_greedy(tiny_llama_dir, [p[1:] + [9] for p in PROMPTS])  # the input matters
    llm = LLM(tiny_llama_dir, dtype="float32")
    assert llm.llm_engine.cpu_paths.small_linear_kernel
    packed = _packed_weights(llm.llm_engine.model)
    assert packed and all(isinstance(weight, KernelPacked) for weight in packed)
    assert _greedy(llm, PROMPTS) == expected
    llm.close()
    llm = LLM(tiny_llama_dir, dtype="bfloat16")  # the load check passes on the bfloat16 kernel
    assert any(isinstance(weight, KernelPacked) for weight in _packed_weights(llm.llm_engine.model))
    assert all(len(tokens) == 8 for tokens in _greedy(llm, PROMPTS))
    llm.close()


def test_each_shape_is_raced_once_and_the_cached_ratio_decides(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))
    choose = linear_race.small_kernel_choice(rows_hint=64, forced=False)
    choose(48, 32, torch.float32)
    cache = tmp_path / "cpu_paths.json"
    measured = json.loads(cache.read_text())  # one ratio per row count
    assert len(measured) == len(KERNEL_ROW_COUNTS) and all(ratio >= 0 for ratio in measured.values())
    for ratio, taken in ((0.5, frozenset()), (2.0, frozenset(KERNEL_ROW_COUNTS))):
        cache.write_text(json.dumps({key: ratio for key in measured}))
        assert choose(48, 32, torch.float32) == taken
    choose(48, 40, torch.float32)  # another shape races on its own
    assert len(json.loads(cache.read_text())) == 2 * len(KERNEL_ROW_COUNTS)
    assert linear_race.small_kernel_choice(rows_hint=64, forced=True)(48, 40, torch.float32) == frozenset(
        KERNEL_ROW_COUNTS)


@pytest.mark.parametrize("rows", [3, 40, KERNEL_ROW_COUNTS[-1] + 5])
def test_packed_matmul_takes_the_kernel_at_its_row_counts_and_gives_the_product(rows):
    """Row counts up to 4 through the kernel here, others through oneDNN; either way
    the float32 product."""
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(40, 24, generator=generator), torch.randn(40, generator=generator)
    packed = pack_weight(weight, 64, lambda *_: frozenset({1, 2, 4}))
    if not isinstance(packed, KernelPacked):
        pytest.skip("the kernel does not read oneDNN's layout on this host")
    assert packed.takes(rows) == (rows <= 4)
    x = torch.randn(rows, 24, generator=generator)
    torch.testing.assert_close(packed_matmul(x, packed, bias), torch.nn.functional.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-4)


def test_off_unless_turned_on(monkeypatch):
    from shardline.engine.cpu.capability import ModelShape
    from shardline.engine.cpu.paths import choose_cpu_paths

    monkeypatch.delenv("SHARDLINE_CPU_PATHS", raising=False)
    shape = ModelShape(hidden_size=64, widest_linear=192, num_heads=4, num_kv_heads=2, head_dim=16)
    paths = choose_cpu_paths(torch.float32, shape, rows_hint=64)
    assert not paths.small_linear_kernel
    assert dict(paths.reasons)["small_linear_kernel"] in ("off unless SHARDLINE_CPU_PATHS turns it on",
                                                         "it runs packed linears, which are not taken")
